//! Four eyes: sensitive actions wait as approval requests until a second person with the approver
//! role approves (the effect runs in the approving transaction, once: the request is locked and
//! must still be pending in the version seen) or rejects. Nobody decides their own request (checked
//! here and by a CHECK constraint).
//!
//! There is at most one pending request per (action, target) (a unique index): asking again
//! answers with the first. A request on a process whose version moved on since it was asked is
//! closed as `superseded` ([`supersede_stale`], before every listing, request and decision):
//! nothing runs, and whoever still wants it asks again on what the process is now. A listed request
//! on a process carries the process as it is now (status, version, redacted input), so the page
//! can show it in business terms.

use crate::actions::audit::outcome;
use crate::actions::run::Acting;
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::Change;
use crate::targets::ordered::{self, OrderedAction};
use crate::targets::processes::{ConsoleWords, ProcessActionRequest};
use crate::targets::{dead_letters, outbox_dead};
use crate::{internal_events, redact};
use chrono::{DateTime, Utc};
use consumer::ordered::admin::Discard;
use processes::admin::ActionKind;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};
use utoipa::ToSchema;
use uuid::Uuid;

/// What runs on approval.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Pending {
    OutboxRequeue {
        items: Vec<outbox_dead::Item>,
    },
    DlqReplay {
        consumer: String,
        items: Vec<dead_letters::Item>,
    },
    Process {
        id: Uuid,
        action: ActionKind,
        request: ProcessActionRequest,
    },
    /// A skip or a dead-lettered run on an ordered consumer's aggregate.
    OrderedDiscard(ordered::DiscardRequest),
    /// One process action on the processes a filter selected, frozen with their versions.
    ProcessBulk(crate::targets::processes::BulkPending),
}

impl Pending {
    pub fn action_name(&self) -> &'static str {
        match self {
            Pending::OutboxRequeue { .. } => "outbox.requeue",
            Pending::DlqReplay { .. } => "dlq.replay",
            Pending::Process { action, .. } => action.audit_name(),
            Pending::ProcessBulk(b) => crate::targets::processes::bulk_audit_name(b.action),
            Pending::OrderedDiscard(r) => match r.discard {
                Discard::Head => OrderedAction::Skip.audit_name(),
                Discard::Run => OrderedAction::DeadLetterRun.audit_name(),
            },
        }
    }
}

/// An approval request as shown.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct Approval {
    pub id: Uuid,
    pub action: String,
    /// What it acts on, as the audit log names it (`process:<id>`, ...).
    pub target: Option<String>,
    pub request: Value,
    pub reason: String,
    pub requested_by: String,
    pub requested_at: DateTime<Utc>,
    pub status: String,
    pub version: i32,
    pub decided_by: Option<String>,
    pub decided_at: Option<DateTime<Utc>>,
    pub decision_reason: Option<String>,
    pub result: Option<Value>,
    /// For a request on a process: the process now (`id`, `kind`, `business_key`, `status`,
    /// `version`, `paused`, `input` redacted).
    pub process: Option<Value>,
}

/// A request made, or the pending one for the same action and target that it answers with.
#[derive(Debug)]
pub struct Requested {
    pub id: Uuid,
    /// An earlier pending request for the same action and target.
    pub existing: bool,
    /// The audit entry.
    pub change: Change,
}

impl Requested {
    /// The answer to the request (202).
    pub fn body(&self) -> Value {
        json!({"approval": self.id, "status": "pending", "existing": self.existing})
    }

    /// The action's effect: 202 with [`body`](Self::body), and the request's audit entry.
    pub fn effect(self) -> crate::actions::run::Effect {
        crate::actions::run::Effect {
            status: axum::http::StatusCode::ACCEPTED,
            body: self.body(),
            changes: vec![self.change],
        }
    }
}

/// Closes as `superseded` every pending request whose subject moved on since the request saw it:
/// a process whose version changed, an ordered consumer's aggregate whose applied position
/// changed (nothing runs; nobody decided it). Returns how many.
pub async fn supersede_stale(
    conn: &mut PgConnection,
    state: &AppState,
) -> Result<u64, ConsoleError> {
    let processes = sqlx::query(state.schema.sql(
        "UPDATE {{schema}}.console_approvals a SET status = 'superseded', version = a.version + 1, \
                decided_at = now(), \
                result = jsonb_build_object('superseded', 'the process changed since the request (version ' \
                         || (a.request->'request'->>'version') || ', now ' || p.row_version || ')') \
         FROM {{schema}}.processes p \
         WHERE a.status = 'pending' AND a.request->>'kind' = 'process' \
           AND p.id = (a.request->>'id')::uuid \
           AND p.row_version IS DISTINCT FROM (a.request->'request'->>'version')::bigint",
    ))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let aggregates = sqlx::query(state.schema.sql(
        "UPDATE {{schema}}.console_approvals a SET status = 'superseded', version = a.version + 1, \
                decided_at = now(), \
                result = jsonb_build_object('superseded', 'the aggregate moved on since the request (position ' \
                         || (a.request->>'version') || ', now ' || coalesce(p.applied_seq::text, 'gone') || ')') \
         FROM {{schema}}.console_approvals r \
         LEFT JOIN {{schema}}.consumer_positions p ON p.consumer = r.request->>'consumer' \
              AND p.aggregate_type = r.request->>'aggregate_type' AND p.aggregate_id = r.request->>'aggregate_id' \
         WHERE a.id = r.id AND a.status = 'pending' AND a.request->>'kind' = 'ordered_discard' \
           AND p.applied_seq IS DISTINCT FROM (a.request->>'version')::bigint",
    ))
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(processes + aggregates)
}
/// Body of approve and reject.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Decision {
    pub reason: String,
    /// The approval's version seen (1 while pending).
    pub version: i32,
}

/// Requests, newest first (`status` filters).
pub async fn list(
    pool: &PgPool,
    state: &AppState,
    status: Option<&str>,
) -> Result<Vec<Approval>, ConsoleError> {
    query(pool, state, status, None).await
}

/// The requests of actions on process `id`, newest first.
pub async fn of_process(
    pool: &PgPool,
    state: &AppState,
    id: Uuid,
) -> Result<Vec<Approval>, ConsoleError> {
    query(pool, state, None, Some(id)).await
}

async fn query(
    pool: &PgPool,
    state: &AppState,
    status: Option<&str>,
    process: Option<Uuid>,
) -> Result<Vec<Approval>, ConsoleError> {
    supersede_stale(&mut *pool.acquire().await?, state).await?;
    let rows = sqlx::query_as::<_, Approval>(state.schema.sql(
        "SELECT a.id, a.action, a.target, a.request, a.reason, r.name AS requested_by, a.requested_at, a.status, a.version, \
                d.name AS decided_by, a.decided_at, a.decision_reason, a.result, \
                CASE WHEN p.id IS NOT NULL THEN jsonb_build_object('id', p.id, 'kind', p.kind, \
                    'business_key', p.business_key, 'status', p.status, 'version', p.row_version, \
                    'paused', p.paused, 'input', p.input_redacted, 'money', p.money) END AS process \
         FROM {{schema}}.console_approvals a \
         JOIN {{schema}}.console_users r ON r.id = a.requested_by \
         LEFT JOIN {{schema}}.console_users d ON d.id = a.decided_by \
         LEFT JOIN {{schema}}.processes p ON a.request->>'kind' = 'process' AND p.id = (a.request->>'id')::uuid \
         WHERE ($1::text IS NULL OR a.status = $1) \
           AND ($2::uuid IS NULL OR (a.request->>'kind' = 'process' AND a.request->>'id' = $2::text)) \
         ORDER BY a.requested_at DESC LIMIT 500",
    ))
    .bind(status)
    .bind(process)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|mut a| {
            a.request = redact::value(&a.request);
            a.result = a.result.as_ref().map(redact::value);
            a.process = a.process.as_ref().map(redact::value);
            a.target = a.target.as_deref().map(redact::text);
            a.reason = redact::text(&a.reason);
            a.decision_reason = a.decision_reason.as_deref().map(redact::text);
            a
        })
        .collect())
}

/// Creates a request for `pending` in the action's transaction, by its principal with its reason
/// on its target, or finds the pending one for the same action and target (which it answers with;
/// a stale one is superseded first).
pub async fn create(on: &mut Acting<'_>, pending: &Pending) -> Result<Requested, ConsoleError> {
    let (state, principal, reason, target) = (on.state, on.principal, on.reason, on.target);
    let conn = &mut *on.conn;
    let request =
        serde_json::to_value(pending).map_err(|e| ConsoleError::Internal(e.to_string()))?;
    supersede_stale(conn, state).await?;
    // A concurrent request for the same action and target waits here for the other's commit
    // (the unique index), then finds it.
    let made: Option<Uuid> = sqlx::query_scalar(state.schema.sql(
        "INSERT INTO {{schema}}.console_approvals (action, target, request, reason, requested_by) \
         VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (action, target) WHERE status = 'pending' DO NOTHING RETURNING id",
    ))
    .bind(pending.action_name())
    .bind(target)
    .bind(&request)
    .bind(reason)
    .bind(principal.id)
    .fetch_optional(&mut *conn)
    .await?;
    let (id, existing) = match made {
        Some(id) => (id, false),
        None => {
            let id: Uuid = sqlx::query_scalar(state.schema.sql(
                "SELECT id FROM {{schema}}.console_approvals \
                 WHERE action = $1 AND target = $2 AND status = 'pending'",
            ))
            .bind(pending.action_name())
            .bind(target)
            .fetch_one(&mut *conn)
            .await?;
            (id, true)
        }
    };
    Ok(Requested {
        id,
        existing,
        change: Change {
            target: target.to_string(),
            after: Some(
                json!({"approval": id, "status": "pending", "existing": existing, "request": request}),
            ),
            outcome: Some(outcome::REQUESTED),
            approval_id: Some(id),
            ..Default::default()
        },
    })
}

/// A pending request as stored, locked for a decision.
struct Stored {
    pending: Pending,
    requester: Principal,
    version: i32,
    reason: String,
}

/// Loads and locks request `id` for `principal`'s decision: someone else's, still pending, at the
/// version the decider saw.
async fn lock_for_decision(
    conn: &mut PgConnection,
    state: &AppState,
    principal: &Principal,
    id: Uuid,
    decision: &Decision,
) -> Result<Stored, ConsoleError> {
    let row: Option<(Uuid, String, String, Value, String, i32, String)> = sqlx::query_as(state.schema.sql(
        "SELECT a.requested_by, u.name, u.role, a.request, a.status, a.version, a.reason FROM {{schema}}.console_approvals a \
         JOIN {{schema}}.console_users u ON u.id = a.requested_by WHERE a.id = $1 FOR UPDATE OF a",
    ))
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((
        requested_by,
        requester_name,
        requester_role,
        request,
        status,
        version,
        requested_reason,
    )) = row
    else {
        return Err(ConsoleError::NotFound(format!("approval request {id}")));
    };
    if requested_by == principal.id {
        return Err(ConsoleError::Forbidden(
            "nobody approves or rejects their own request".into(),
        ));
    }
    if status != "pending" {
        return Err(ConsoleError::Conflict(format!(
            "approval request {id} is already {status}"
        )));
    }
    if version != decision.version {
        return Err(ConsoleError::Conflict(format!(
            "approval request {id} changed since version {} (now {version})",
            decision.version
        )));
    }
    let pending: Pending = serde_json::from_value(request)
        .map_err(|e| ConsoleError::Internal(format!("approval request {id} is unreadable: {e}")))?;
    let requester = Principal {
        id: requested_by,
        name: requester_name,
        role: requester_role
            .parse()
            .map_err(|e: crate::auth::roles::UnknownRole| ConsoleError::Internal(e.to_string()))?,
    };
    Ok(Stored {
        pending,
        requester,
        version,
        reason: requested_reason,
    })
}

/// Approves or rejects request `id` as `principal`, in the caller's transaction. On approval the
/// effect runs here; its audit entries name the requester as actor and `principal` as approver.
pub async fn decide(
    conn: &mut PgConnection,
    state: &AppState,
    principal: &Principal,
    id: Uuid,
    decision: &Decision,
    approve: bool,
) -> Result<(Vec<Change>, Value), ConsoleError> {
    // A request whose process moved on is closed first: it answers 409 below, superseded.
    supersede_stale(conn, state).await?;
    let Stored {
        pending,
        requester,
        version,
        reason: requested_reason,
    } = lock_for_decision(conn, state, principal, id, decision).await?;
    let (mut changes, result) = if approve {
        let (changes, result) = run(
            conn,
            state,
            &pending,
            &requester,
            principal,
            &requested_reason,
        )
        .await?;
        let changes = changes
            .into_iter()
            .map(|c| Change {
                actor: Some(requester.clone()),
                action: Some(pending.action_name().to_string()),
                approval_id: Some(id),
                approver: Some(principal.name.clone()),
                // The effect's reason is the requester's; the approver's is on the approval entry.
                reason: Some(requested_reason.clone()),
                ..c
            })
            .collect::<Vec<_>>();
        (changes, result)
    } else {
        (Vec::new(), json!({"rejected": true}))
    };
    sqlx::query(state.schema.sql(
        "UPDATE {{schema}}.console_approvals SET status = $2, version = version + 1, decided_by = $3, \
                decided_at = now(), decision_reason = $4, result = $5 WHERE id = $1",
    ))
    .bind(id)
    .bind(if approve { "approved" } else { "rejected" })
    .bind(principal.id)
    .bind(&decision.reason)
    .bind(&result)
    .execute(&mut *conn)
    .await?;
    changes.push(Change {
        target: format!("approval:{id}"),
        before: Some(json!({"status": "pending", "version": version})),
        after: Some(
            json!({"status": if approve { "approved" } else { "rejected" }, "result": result}),
        ),
        outcome: Some(if approve {
            outcome::APPROVED
        } else {
            outcome::REJECTED
        }),
        approval_id: Some(id),
        approver: Some(principal.name.clone()),
        ..Default::default()
    });
    Ok((
        changes,
        json!({"approval": id, "status": if approve { "approved" } else { "rejected" }, "result": result}),
    ))
}

/// Runs an approved request's effect, asked by `requester`, approved by `approver`.
async fn run(
    conn: &mut PgConnection,
    state: &AppState,
    pending: &Pending,
    requester: &Principal,
    approver: &Principal,
    reason: &str,
) -> Result<(Vec<Change>, Value), ConsoleError> {
    match pending {
        Pending::OrderedDiscard(request) => {
            let why = format!(
                "{reason} (asked by {}, approved by {})",
                requester.name, approver.name
            );
            ordered::discard(conn, &state.schema, &state.settings, request, &why).await
        }
        Pending::OutboxRequeue { items } => outbox_dead::requeue(conn, &state.schema, items).await,
        Pending::DlqReplay { consumer, items } => {
            dead_letters::replay(
                &state.settings.amqp_url,
                &state.settings.amqp_tls,
                consumer,
                items,
            )
            .await
        }
        Pending::Process {
            id,
            action,
            request,
        } => {
            let (before, after) = state
                .processes
                .perform(
                    conn,
                    *id,
                    *action,
                    request,
                    &requester.name,
                    Some(&approver.name),
                )
                .await?;
            Ok((vec![Change::process(*id, before, after.clone())], after))
        }
        Pending::ProcessBulk(bulk) => {
            state
                .processes
                .run_bulk(conn, bulk, reason, &requester.name, &approver.name)
                .await
        }
    }
}

/// Sets `console_approvals_pending` from the table.
pub async fn refresh_pending_gauge(state: &AppState) {
    let n: Result<i64, sqlx::Error> = sqlx::query_scalar(
        state
            .schema
            .sql("SELECT count(*) FROM {{schema}}.console_approvals WHERE status = 'pending'"),
    )
    .fetch_one(&state.pool)
    .await;
    if let Ok(n) = n {
        internal_events::approvals_pending(n);
    }
}
