//! The console's actions, as the API and the web page both call them: each builds its effect and
//! hands it to [`actions::perform`] (role check, idempotency, audit, one transaction).

use crate::actions::Action;
use crate::actions::approvals::{self, Decision, Pending};
use crate::actions::audit;
use crate::actions::{self, Effect, Outcome, Request};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::ordered::{self, OrderedAction};
use crate::targets::processes::ProcessActionRequest;
use crate::targets::{dead_letters, outbox_dead};
use axum::http::StatusCode;
use processes::admin::ActionKind;
use serde_json::json;
use uuid::Uuid;

fn targets<T>(prefix: &str, items: &[T], id: impl Fn(&T) -> String) -> String {
    let ids: Vec<String> = items.iter().map(id).collect();
    format!("{prefix}{}", ids.join(","))
}

/// Requeue dead outbox rows: one runs now, more than one creates an approval request, a dry run
/// says what each would do.
pub async fn requeue_outbox(
    state: &AppState,
    principal: &Principal,
    items: Vec<outbox_dead::Item>,
    reason: &str,
    dry_run: bool,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let target = targets("outbox:", &items, |i| i.id.to_string());
    if dry_run {
        actions::authorize(state, principal, Action::OutboxRequeue, &target, reason).await?;
        let mut conn = state.pool.acquire().await?;
        let plan = outbox_dead::plan(&mut conn, &state.schema, &items).await?;
        return Ok(read(
            json!({"dry_run": true, "needs_approval": items.len() > 1, "items": plan}),
        ));
    }
    let reason = match actions::require_reason(reason) {
        Ok(r) => r,
        Err(e) => {
            actions::authorize(state, principal, Action::OutboxRequeue, &target, reason).await?;
            return Err(e);
        }
    };
    if items.is_empty() {
        actions::authorize(state, principal, Action::OutboxRequeue, &target, &reason).await?;
        return Err(ConsoleError::BadRequest("no rows given".into()));
    }
    let (schema, st, p, r, t) = (
        state.schema.clone(),
        state.clone(),
        principal.clone(),
        reason.clone(),
        target.clone(),
    );
    let req = Request {
        principal,
        action: Action::OutboxRequeue,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |conn| {
        Box::pin(async move {
            if items.len() == 1 {
                let (changes, body) = outbox_dead::requeue(conn, &schema, &items).await?;
                Ok(Effect {
                    status: StatusCode::OK,
                    body,
                    changes,
                })
            } else {
                outbox_dead::check(conn, &schema, &items, false).await?;
                let pending = Pending::OutboxRequeue { items };
                let requested = approvals::create(conn, &st, &p, &pending, &r, &t).await?;
                Ok(Effect {
                    status: StatusCode::ACCEPTED,
                    body: requested.body(),
                    changes: vec![requested.change],
                })
            }
        })
    })
    .await
}

/// Replay consumer dead letters (same shape as [`requeue_outbox`]).
pub async fn replay_dead_letters(
    state: &AppState,
    principal: &Principal,
    consumer: String,
    items: Vec<dead_letters::Item>,
    reason: &str,
    dry_run: bool,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let target = targets(&format!("dlq:{consumer}/"), &items, |i| {
        i.message_id.clone()
    });
    actions::authorize(state, principal, Action::DlqReplay, &target, reason).await?;
    dead_letters::listed(&state.settings.consumers, &consumer)?;
    crate::text::check_all(items.iter().flat_map(|i| {
        [
            ("message_id", Some(i.message_id.as_str())),
            ("version", Some(i.version.as_str())),
        ]
    }))?;
    if dry_run {
        let plan = dead_letters::plan(
            &state.settings.amqp_url,
            &state.settings.amqp_tls,
            &consumer,
            &items,
        )
        .await?;
        return Ok(read(
            json!({"dry_run": true, "needs_approval": items.len() > 1, "items": plan}),
        ));
    }
    let reason = actions::require_reason(reason)?;
    let (st, p, r, t) = (
        state.clone(),
        principal.clone(),
        reason.clone(),
        target.clone(),
    );
    let req = Request {
        principal,
        action: Action::DlqReplay,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |conn| {
        Box::pin(async move {
            if items.len() == 1 {
                let (changes, body) = dead_letters::replay(
                    &st.settings.amqp_url,
                    &st.settings.amqp_tls,
                    &consumer,
                    &items,
                )
                .await?;
                Ok(Effect {
                    status: StatusCode::OK,
                    body,
                    changes,
                })
            } else {
                dead_letters::check(
                    &st.settings.amqp_url,
                    &st.settings.amqp_tls,
                    &consumer,
                    &items,
                )
                .await?;
                let pending = Pending::DlqReplay { consumer, items };
                let requested = approvals::create(conn, &st, &p, &pending, &r, &t).await?;
                Ok(Effect {
                    status: StatusCode::ACCEPTED,
                    body: requested.body(),
                    changes: vec![requested.change],
                })
            }
        })
    })
    .await
}

/// Approve or reject an approval request.
pub async fn decide(
    state: &AppState,
    principal: &Principal,
    id: Uuid,
    decision: Decision,
    approve: bool,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let action = if approve {
        Action::ApprovalApprove
    } else {
        Action::ApprovalReject
    };
    let target = format!("approval:{id}");
    actions::authorize(state, principal, action, &target, &decision.reason).await?;
    let reason = actions::require_reason(&decision.reason)?;
    // Requests whose process moved on are closed as superseded for good (committed on their own:
    // the decision below then answers 409 and rolls back).
    approvals::supersede_stale(&mut *state.pool.acquire().await?, state).await?;
    let (st, p) = (state.clone(), principal.clone());
    let req = Request {
        principal,
        action,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |conn| {
        Box::pin(async move {
            let (changes, body) = approvals::decide(conn, &st, &p, id, &decision, approve).await?;
            Ok(Effect {
                status: StatusCode::OK,
                body,
                changes,
            })
        })
    })
    .await
}

/// An action on a process: the sensitive ones create an approval request (after checking that the
/// action is allowed now on the version seen), the others run now.
pub async fn process_action(
    state: &AppState,
    principal: &Principal,
    id: Uuid,
    action: ActionKind,
    request: ProcessActionRequest,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let target = format!("process:{id}");
    actions::authorize(
        state,
        principal,
        Action::Process(action),
        &target,
        &request.reason,
    )
    .await?;
    let reason = actions::require_reason(&request.reason)?;
    crate::text::check_all([
        ("evidence", request.evidence.as_deref()),
        (
            "remote_check.checked",
            request.remote_check.as_ref().map(|c| c.checked.as_str()),
        ),
        (
            "remote_check.answer",
            request.remote_check.as_ref().map(|c| c.answer.as_str()),
        ),
    ])?;
    let backend = state.processes.clone();
    let (st, p, r, t) = (
        state.clone(),
        principal.clone(),
        reason.clone(),
        target.clone(),
    );
    let req = Request {
        principal,
        action: Action::Process(action),
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |conn| {
        Box::pin(async move {
            let checked = backend.check(conn, id, action, &request).await?;
            if checked.needs_approval {
                let pending = Pending::Process {
                    id,
                    action,
                    request: checked.request,
                };
                let mut requested = approvals::create(conn, &st, &p, &pending, &r, &t).await?;
                requested.change.before = Some(checked.before);
                Ok(Effect {
                    status: StatusCode::ACCEPTED,
                    body: requested.body(),
                    changes: vec![requested.change],
                })
            } else {
                let (before, after) = backend
                    .perform(conn, id, action, &request, &p.name, None)
                    .await?;
                // The process moved on: requests on the version it had are closed with it.
                approvals::supersede_stale(conn, &st).await?;
                Ok(Effect {
                    status: StatusCode::OK,
                    body: after.clone(),
                    changes: vec![crate::targets::Change::process(id, before, after)],
                })
            }
        })
    })
    .await
}

/// An action on an ordered consumer's stuck aggregate: a retry runs now; a skip or a dead-lettered
/// run is checked on the position seen and recorded for a second person (a dry run says what it
/// would dead-letter).
pub async fn ordered_action(
    state: &AppState,
    principal: &Principal,
    consumer: String,
    action: OrderedAction,
    body: ordered::AggregateAction,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let target = body.target(&consumer);
    actions::authorize(
        state,
        principal,
        Action::Ordered(action),
        &target,
        &body.reason,
    )
    .await?;
    dead_letters::listed(&state.settings.consumers, &consumer)?;
    crate::text::check_all([
        ("aggregate_type", Some(body.aggregate_type.as_str())),
        ("aggregate_id", Some(body.aggregate_id.as_str())),
    ])?;
    if body.dry_run {
        let Some(discard) = action.discard() else {
            return Err(ConsoleError::BadRequest(
                "a retry has no dry run: it discards nothing".into(),
            ));
        };
        let mut tx = state.pool.begin().await?;
        let request = ordered::request(&mut tx, &state.schema, &consumer, discard, &body).await;
        let _ = tx.rollback().await;
        let request = request?;
        return Ok(read(json!({
            "dry_run": true,
            "needs_approval": true,
            "would_dead_letter": request.would_dead_letter,
            "messages": request.messages,
        })));
    }
    let reason = actions::require_reason(&body.reason)?;
    let (st, p, r, t) = (
        state.clone(),
        principal.clone(),
        reason.clone(),
        target.clone(),
    );
    let req = Request {
        principal,
        action: Action::Ordered(action),
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |conn| {
        Box::pin(async move {
            match action.discard() {
                None => {
                    let (changes, body) =
                        ordered::retry(conn, &st.schema, &consumer, &body).await?;
                    Ok(Effect {
                        status: StatusCode::OK,
                        body,
                        changes,
                    })
                }
                Some(discard) => {
                    let request =
                        ordered::request(conn, &st.schema, &consumer, discard, &body).await?;
                    let pending = Pending::OrderedDiscard(request);
                    let requested = approvals::create(conn, &st, &p, &pending, &r, &t).await?;
                    Ok(Effect {
                        status: StatusCode::ACCEPTED,
                        body: requested.body(),
                        changes: vec![requested.change],
                    })
                }
            }
        })
    })
    .await
}

/// Purge audit entries older than the configured retention (admin).
pub async fn purge_audit(
    state: &AppState,
    principal: &Principal,
    reason: &str,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let target = "audit".to_string();
    actions::authorize(state, principal, Action::AuditPurge, &target, reason).await?;
    let reason = actions::require_reason(reason)?;
    let (schema, days) = (state.schema.clone(), state.settings.audit_retention_days);
    let req = Request {
        principal,
        action: Action::AuditPurge,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |conn| {
        Box::pin(async move {
            let removed = audit::purge(conn, &schema, days).await?;
            Ok(Effect {
                status: StatusCode::OK,
                body: json!({"removed": removed, "retention_days": days}),
                changes: vec![crate::targets::Change {
                    target: "audit".into(),
                    after: Some(json!({"removed": removed, "retention_days": days})),
                    ..Default::default()
                }],
            })
        })
    })
    .await
}

fn read(body: serde_json::Value) -> Outcome {
    Outcome {
        status: StatusCode::OK,
        body: body.to_string(),
    }
}
