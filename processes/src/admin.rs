//! What operators (and the console of issue 13) can see and do.
//!
//! Reads ([`list`], [`get`]; [`view`] on the caller's connection) show redacted inputs only. Every
//! action ([`act`]; [`act_in`] inside the caller's transaction, so the console commits its audit
//! entry with the effect) takes a reason, the row version the operator saw (a stale one is
//! [`Error::Stale`] and changes nothing) and an actor, and is allowed only if [`allowed_actions`]
//! offers it for the current state, error class and remote capability. Its transitions are
//! recorded by the database triggers in `process_history` with the actor and reason, in the same
//! transaction as the change; the id of the last such row is returned as the audit reference. An
//! action that takes a process away from a worker also takes a new fencing token, so the worker's
//! remaining writes are fenced off.
//!
//! Some decisions need more than one person's word ([`requirements`]): running a compensation,
//! resolving a step as succeeded, and resolving as failed an external step whose outcome is
//! unknown (the remote may have acted: a charge marked failed that did happen leaves the customer
//! charged with nothing to give it back). Those need a second person ([`Request::approved_by`]);
//! the last one also needs a [`RemoteCheck`], what was checked at the remote and its answer. For
//! such a step the view names the doubt and the safe action for the remote's capability
//! ([`Doubt`]), which [`allowed_actions`] lists first.

use crate::error::Error;
use crate::redact;
use crate::status::{ProcessStatus, StepStatus};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use shared::schema::Schema;
use sqlx::{FromRow, PgConnection, PgPool, Row};
use uuid::Uuid;

/// The operators' decisions over the steps live with the worker's, in [`crate::decide`].
pub use crate::decide::{allowed_actions, doubts, requirements};

/// One process, as listed (a row of its columns, `PROCESS_COLUMNS`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ProcessSummary {
    pub id: Uuid,
    pub kind: String,
    pub definition_version: i32,
    pub business_key: String,
    pub revision: i32,
    pub revision_of: Option<Uuid>,
    pub status: ProcessStatus,
    pub paused: bool,
    pub attempt: i32,
    pub last_reason: String,
    pub last_actor: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub deadline_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    pub row_version: i64,
}

/// One step, as shown (a row of the columns `steps_of` reads).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StepView {
    pub seq: i32,
    pub name: String,
    pub role: String,
    pub acts_on: Option<i32>,
    pub execution: String,
    pub remote: Option<String>,
    pub sensitive: bool,
    pub status: StepStatus,
    pub operation_id: Uuid,
    pub attempts: i32,
    pub max_attempts: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub first_attempt_at: Option<DateTime<Utc>>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    pub remote_ref: Option<String>,
    pub result_ref: Option<String>,
    pub last_reason: String,
    pub last_actor: String,
    /// For a wait step: the correlation key of the awaited event, set when the wait began.
    pub wait_key: Option<String>,
    /// For wait and timer steps: when the wait began.
    pub wait_since: Option<DateTime<Utc>>,
    /// For a wait step: its deadline (then the remote is queried, or the step goes to manual
    /// review); for a timer: when the process continues.
    pub wait_until: Option<DateTime<Utc>>,
    /// The dependency whose circuit the step waits on (a retryable step, woken when the circuit
    /// lets calls go again); `None` otherwise.
    pub waiting_for: Option<String>,
    /// Since when the step has waited for an unavailable remote.
    pub waiting_since: Option<DateTime<Utc>>,
}

impl StepView {
    /// A wait or timer step its process is parked on: its time (deadline or timer) is stored and
    /// the step has not ended.
    pub fn is_parked(&self) -> bool {
        matches!(self.execution.as_str(), "wait" | "timer")
            && self.wait_until.is_some()
            && matches!(self.status, StepStatus::Running | StepStatus::Retryable)
    }

    /// A wait step its process is parked on: no event yet, its deadline not handled yet.
    pub fn is_waiting(&self) -> bool {
        self.execution == "wait" && self.is_parked()
    }
}

/// One recorded transition (a row of `process_history`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct HistoryEntry {
    pub id: i64,
    pub step_seq: Option<i32>,
    pub from_status: Option<String>,
    pub to_status: String,
    pub reason: String,
    pub actor: String,
    pub lease_token: i64,
    pub at: DateTime<Utc>,
}

/// A process with its steps, its history and the actions allowed now.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessView {
    pub process: ProcessSummary,
    pub input: Value,
    /// The input amounts the definition declares money, as stored at start
    /// ([`crate::money`]); empty when it declares none.
    pub money: Vec<crate::money::Amount>,
    pub steps: Vec<StepView>,
    pub history: Vec<HistoryEntry>,
    /// Safe actions first (see [`allowed_actions`]).
    pub allowed: Vec<Action>,
    /// The external steps waiting for a decision whose outcome is unknown.
    pub doubts: Vec<Doubt>,
}

/// An external step in manual review whose last outcome is unknown: the remote may have acted.
/// Deciding it either way on a guess loses money (a charge resolved as failed that did happen
/// leaves the customer charged; one resolved as succeeded that did not ships unpaid goods).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Doubt {
    pub seq: i32,
    pub name: String,
    /// The remote's capability (`honours_key`, `queryable`, `none`).
    pub remote: Option<String>,
    /// What to tell the person deciding.
    pub warning: String,
    /// The action that settles the doubt without guessing, for this remote: rerun with the same
    /// key (the remote deduplicates), or query by operation id. `None` when the remote can do
    /// neither: someone must look at the remote and record what they found.
    pub safe_action: Option<Action>,
}

/// What an action needs besides a reason, for the process as it is now ([`requirements`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Requirements {
    /// [`Request::evidence`]: the remote's reference or a ticket (resolve_succeeded).
    pub evidence: bool,
    /// [`Request::remote_check`]: what was checked at the remote and its answer (resolving a
    /// step in doubt as failed).
    pub remote_check: bool,
    /// [`Request::approved_by`]: a second person, other than the actor.
    pub second_person: bool,
}

/// What was checked at the remote, and what it answered: the evidence that lets a person resolve
/// as failed a step whose outcome was unknown (e.g. "provider dashboard, charges by reference
/// 7f3c...", "no charge").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct RemoteCheck {
    /// What was looked at (where, by which reference or operation id).
    pub checked: String,
    /// What the remote answered.
    pub answer: String,
}

impl RemoteCheck {
    /// Each part is 1 to 240 bytes (trimmed), so both fit the 500 bytes a reference keeps.
    pub const MAX_PART: usize = 240;

    fn checked(&self) -> Result<RemoteCheck, Error> {
        let part = |what: &str, v: &str| {
            let v = v.trim();
            if v.is_empty() || v.len() > Self::MAX_PART {
                Err(Error::Invalid(format!(
                    "the remote check's {what} must be 1 to {} bytes",
                    Self::MAX_PART
                )))
            } else {
                Ok(v.to_string())
            }
        };
        Ok(RemoteCheck {
            checked: part("'checked'", &self.checked)?,
            answer: part("'answer'", &self.answer)?,
        })
    }

    /// As the resolution step keeps it.
    pub fn reference(&self) -> String {
        format!("checked: {}; answer: {}", self.checked, self.answer)
    }
}

/// The kinds of operator action, without their step: the one vocabulary of process actions.
/// This crate's history, and every tool that offers the actions (the console's URLs, audit log
/// and role matrix), name them by [`ActionKind::name`], so no tool keeps its own list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    /// See [`Action::RerunStep`].
    RerunStep,
    /// See [`Action::QueryRemote`].
    #[serde(rename = "query_remote_status")]
    QueryRemote,
    Escalate,
    Pause,
    Resume,
    /// See [`Action::RunCompensation`].
    RunCompensation,
    /// See [`Action::ResolveSucceeded`].
    ResolveSucceeded,
    /// See [`Action::ResolveFailed`].
    ResolveFailed,
    Cancel,
}

impl ActionKind {
    pub const ALL: [ActionKind; 9] = [
        ActionKind::RerunStep,
        ActionKind::QueryRemote,
        ActionKind::Escalate,
        ActionKind::Pause,
        ActionKind::Resume,
        ActionKind::RunCompensation,
        ActionKind::ResolveSucceeded,
        ActionKind::ResolveFailed,
        ActionKind::Cancel,
    ];

    /// The action's name: in the history's reasons, in URLs and audit entries of the tools.
    pub fn name(self) -> &'static str {
        match self {
            ActionKind::RerunStep => "rerun_step",
            ActionKind::QueryRemote => "query_remote_status",
            ActionKind::Escalate => "escalate",
            ActionKind::Pause => "pause",
            ActionKind::Resume => "resume",
            ActionKind::RunCompensation => "run_compensation",
            ActionKind::ResolveSucceeded => "resolve_succeeded",
            ActionKind::ResolveFailed => "resolve_failed",
            ActionKind::Cancel => "cancel",
        }
    }

    /// The kind named `name` ([`ActionKind::name`]).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Acts on one step (the action names its `seq`).
    pub fn on_step(self) -> bool {
        matches!(
            self,
            ActionKind::RerunStep
                | ActionKind::QueryRemote
                | ActionKind::RunCompensation
                | ActionKind::ResolveSucceeded
                | ActionKind::ResolveFailed
        )
    }

    /// The action of this kind on step `seq` (ignored by actions on the whole process).
    pub fn on(self, seq: i32) -> Action {
        match self {
            ActionKind::RerunStep => Action::RerunStep { seq },
            ActionKind::QueryRemote => Action::QueryRemote { seq },
            ActionKind::Escalate => Action::Escalate,
            ActionKind::Pause => Action::Pause,
            ActionKind::Resume => Action::Resume,
            ActionKind::RunCompensation => Action::RunCompensation { seq },
            ActionKind::ResolveSucceeded => Action::ResolveSucceeded { seq },
            ActionKind::ResolveFailed => Action::ResolveFailed { seq },
            ActionKind::Cancel => Action::Cancel,
        }
    }
}

impl std::fmt::Display for ActionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What an operator can do. Actions on a step name its `seq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Run an idempotent step again (local, or a remote that honours its key).
    RerunStep {
        seq: i32,
    },
    /// Let a worker ask the remote by operation id whether the step's operation happened.
    #[serde(rename = "query_remote_status")]
    QueryRemote {
        seq: i32,
    },
    /// Stop automation: the process waits in manual_review.
    Escalate,
    Pause,
    Resume,
    /// Approve (or retry) a compensation waiting in manual_review.
    RunCompensation {
        seq: i32,
    },
    /// The step did happen: `evidence` (a remote reference, a ticket) is required.
    ResolveSucceeded {
        seq: i32,
    },
    /// The step did not happen and will not: forward steps then compensate earlier effects.
    ResolveFailed {
        seq: i32,
    },
    Cancel,
}

impl Action {
    /// The step it acts on, if any.
    pub fn seq(&self) -> Option<i32> {
        match *self {
            Action::RerunStep { seq }
            | Action::QueryRemote { seq }
            | Action::RunCompensation { seq }
            | Action::ResolveSucceeded { seq }
            | Action::ResolveFailed { seq } => Some(seq),
            Action::Escalate | Action::Pause | Action::Resume | Action::Cancel => None,
        }
    }

    /// Its kind, without the step.
    pub fn kind(&self) -> ActionKind {
        match self {
            Action::RerunStep { .. } => ActionKind::RerunStep,
            Action::QueryRemote { .. } => ActionKind::QueryRemote,
            Action::Escalate => ActionKind::Escalate,
            Action::Pause => ActionKind::Pause,
            Action::Resume => ActionKind::Resume,
            Action::RunCompensation { .. } => ActionKind::RunCompensation,
            Action::ResolveSucceeded { .. } => ActionKind::ResolveSucceeded,
            Action::ResolveFailed { .. } => ActionKind::ResolveFailed,
            Action::Cancel => ActionKind::Cancel,
        }
    }

    /// Its kind's name ([`ActionKind::name`]), as the history records it.
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Sensitive whatever the step: running a compensation (a refund) and resolving as
    /// succeeded always need a second person. Resolving as failed needs one when the step is in
    /// doubt ([`requirements`] decides on the steps).
    pub fn sensitive(&self) -> bool {
        matches!(
            self,
            Action::RunCompensation { .. } | Action::ResolveSucceeded { .. }
        )
    }
}

/// An operator's request.
#[derive(Debug, Clone)]
pub struct Request {
    pub action: Action,
    pub reason: String,
    /// `row_version` of the process as the operator saw it.
    pub seen_version: i64,
    pub actor: String,
    /// Required by [`Action::ResolveSucceeded`].
    pub evidence: Option<String>,
    /// Required to resolve a step in doubt as failed ([`Requirements::remote_check`]).
    pub remote_check: Option<RemoteCheck>,
    /// The second person, where [`Requirements::second_person`]: not the actor. The history
    /// records the actor as `<actor> (approved by <approved_by>)`.
    pub approved_by: Option<String>,
}

/// What an action did.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The process_history row of the last transition it made: the audit reference.
    pub audit_ref: i64,
    pub row_version: i64,
    pub status: ProcessStatus,
}

/// Filter for [`list`].
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub kind: Option<String>,
    pub status: Option<ProcessStatus>,
    /// Only processes created at least this many seconds ago (the ones that should be done).
    pub older_than_seconds: Option<i64>,
    pub limit: Option<i64>,
}

pub(crate) const PROCESS_COLUMNS: &str = "id, kind, definition_version, business_key, revision, revision_of, status, paused, \
    attempt, last_reason, last_actor, created_at, updated_at, finished_at, deadline_at, lease_owner, lease_until, row_version";

/// The oldest age a list filters by (a century).
const MAX_AGE_SECONDS: i64 = 100 * 365 * 86_400;

/// Processes, manual_review first, then most recently changed.
pub async fn list(
    pool: &PgPool,
    schema: &Schema,
    filter: &Filter,
) -> Result<Vec<ProcessSummary>, Error> {
    Ok(sqlx::query_as(schema.sql(&format!(
        "SELECT {PROCESS_COLUMNS} FROM {{{{schema}}}}.processes \
         WHERE ($1::text IS NULL OR kind = $1) AND ($2::text IS NULL OR status = $2) \
           AND ($4::bigint IS NULL OR created_at <= now() - make_interval(secs => $4)) \
         ORDER BY (status = 'manual_review') DESC, updated_at DESC LIMIT $3"
    )))
    .bind(&filter.kind)
    .bind(filter.status)
    .bind(filter.limit.unwrap_or(100).clamp(1, 1000))
    // Clamped to a century: a larger age is every process, and PostgreSQL's interval would overflow.
    .bind(
        filter
            .older_than_seconds
            .map(|s| s.clamp(0, MAX_AGE_SECONDS)),
    )
    .fetch_all(pool)
    .await?)
}

/// One process with its steps, history and the actions allowed now.
pub async fn get(pool: &PgPool, schema: &Schema, id: Uuid) -> Result<ProcessView, Error> {
    let mut conn = pool.acquire().await?;
    view(&mut conn, schema, id).await
}

/// [`get`] on the caller's connection (inside its transaction: what that transaction sees).
pub async fn view(
    conn: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
) -> Result<ProcessView, Error> {
    let row = sqlx::query(schema.sql(&format!(
        "SELECT {PROCESS_COLUMNS}, input_redacted, money FROM {{{{schema}}}}.processes WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or(Error::NotFound(id))?;
    let process = ProcessSummary::from_row(&row)?;
    let input: Value = row
        .try_get::<sqlx::types::Json<Value>, _>("input_redacted")?
        .0;
    // A stored entry this version cannot read is left out rather than failing the view.
    let money: Vec<crate::money::Amount> = row
        .try_get::<sqlx::types::Json<Vec<Value>>, _>("money")?
        .0
        .into_iter()
        .filter_map(|a| serde_json::from_value(a).ok())
        .collect();
    let steps = steps_of(conn, schema, id).await?;
    let history: Vec<HistoryEntry> = sqlx::query_as(schema.sql(
        "SELECT id, step_seq, from_status, to_status, reason, actor, lease_token, at \
         FROM {{schema}}.process_history WHERE process_id = $1 ORDER BY id",
    ))
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    let allowed = allowed_actions(&process, &steps);
    let doubts = doubts(&steps);
    Ok(ProcessView {
        process,
        input,
        money,
        steps,
        history,
        allowed,
        doubts,
    })
}

/// The steps of process `id`, in order.
async fn steps_of(
    conn: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
) -> Result<Vec<StepView>, sqlx::Error> {
    sqlx::query_as(schema.sql(
        "SELECT seq, name, role, acts_on, execution, remote, sensitive, status, operation_id, attempts, \
         max_attempts, next_attempt_at, first_attempt_at, last_attempt_at, finished_at, error_class, \
         error_message, remote_ref, result_ref, last_reason, last_actor, wait_key, wait_since, wait_until, \
         waiting_for, waiting_since \
         FROM {{schema}}.process_steps WHERE process_id = $1 ORDER BY seq",
    ))
    .bind(id)
    .fetch_all(&mut *conn)
    .await
}

pub(crate) fn check_reason_actor(reason: &str, actor: &str) -> Result<(), Error> {
    if reason.trim().is_empty() || reason.len() > 900 {
        return Err(Error::Invalid(
            "a reason of 1 to 900 bytes is required".into(),
        ));
    }
    if actor.trim().is_empty() || actor.len() > 200 || actor == "system" {
        return Err(Error::Invalid(
            "an actor (not 'system') of 1 to 200 bytes is required".into(),
        ));
    }
    Ok(())
}

/// The evidence an action with `needs` takes: resolving as succeeded takes 1 to 500 bytes of it
/// (a remote reference, a ticket), trimmed; resolving a step in doubt as failed a
/// [`RemoteCheck`]; other actions neither (what they are given is ignored). A caller that asks
/// for the action before it runs (the console, before an approval) checks with this, so the run
/// cannot fail on it later.
pub fn check_evidence(
    needs: &Requirements,
    evidence: Option<&str>,
    remote_check: Option<&RemoteCheck>,
) -> Result<(Option<String>, Option<RemoteCheck>), Error> {
    let evidence = match evidence.map(str::trim) {
        Some(e) if needs.evidence && !e.is_empty() && e.len() <= 500 => Some(e.to_string()),
        _ if needs.evidence => {
            return Err(Error::Invalid(
                "resolving as succeeded needs evidence (1 to 500 bytes): a remote reference, a ticket"
                    .into(),
            ));
        }
        _ => None,
    };
    let remote_check = match remote_check {
        Some(c) if needs.remote_check => Some(c.checked()?),
        _ if needs.remote_check => {
            return Err(Error::Invalid(
                "the remote may have acted: resolving as failed needs a remote check, what was \
                 checked at the remote and its answer"
                    .into(),
            ));
        }
        _ => None,
    };
    Ok((evidence, remote_check))
}

/// The actor the history records: `actor`, and the second person where one is needed (and none
/// other than the actor). A second person that is not needed is recorded when given.
pub fn check_approver(
    needs: &Requirements,
    action: &Action,
    actor: &str,
    approved_by: Option<&str>,
) -> Result<String, Error> {
    let approver = approved_by.map(str::trim).filter(|a| !a.is_empty());
    match approver {
        Some(a) if a == actor.trim() => Err(Error::NeedsSecondPerson {
            action: action.name().into(),
            why: "the approver must be someone other than the actor".into(),
        }),
        Some(a) if a.len() > 200 => Err(Error::Invalid(
            "an approver of 1 to 200 bytes is required".into(),
        )),
        Some(a) => Ok(redact::truncate(&format!("{actor} (approved by {a})"), 200)),
        None if needs.second_person => Err(Error::NeedsSecondPerson {
            action: action.name().into(),
            why: "a second person must approve it".into(),
        }),
        None => Ok(actor.to_string()),
    }
}

/// Performs `req` on process `id` if it is allowed now and the operator saw the current version,
/// in a transaction of its own.
pub async fn act(
    pool: &PgPool,
    schema: &Schema,
    id: Uuid,
    req: &Request,
) -> Result<Outcome, Error> {
    let mut tx = pool.begin().await?;
    let outcome = act_in(&mut tx, schema, id, req).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// Locks process `id` until the caller's transaction ends (no action and no worker changes it
/// meanwhile) and gives its row version; [`Error::NotFound`] if there is no such process. A
/// caller that shows what an action changes locks first, so its "before" is what the action sees.
pub async fn lock(tx: &mut PgConnection, schema: &Schema, id: Uuid) -> Result<i64, Error> {
    sqlx::query_scalar(
        schema.sql("SELECT row_version FROM {{schema}}.processes WHERE id = $1 FOR UPDATE"),
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(Error::NotFound(id))
}

/// [`act`] inside the caller's transaction, which it does not commit: a caller that records the
/// action elsewhere (the console's audit log) commits both together or neither. On an error the
/// caller must roll back: a database error can come after some of the action's writes.
pub async fn act_in(
    tx: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
    req: &Request,
) -> Result<Outcome, Error> {
    check_reason_actor(&req.reason, &req.actor)?;
    let current = lock(tx, schema, id).await?;
    if current != req.seen_version {
        return Err(Error::Stale {
            id,
            seen: req.seen_version,
            current,
        });
    }
    // Decide on what this transaction sees (the process row is locked).
    let view = get_in(tx, schema, id).await?;
    if !allowed_actions(&view.0, &view.1).contains(&req.action) {
        return Err(Error::NotAllowed {
            action: req.action.name().into(),
            why: format!(
                "process is {}{}",
                view.0.status,
                if view.0.paused { " (paused)" } else { "" }
            ),
        });
    }
    let (_, steps) = view;
    // What the action needs, on the steps as they are now (the process row is locked).
    let needs = requirements(&req.action, &steps);
    let (evidence, remote_check) =
        check_evidence(&needs, req.evidence.as_deref(), req.remote_check.as_ref())?;
    let actor = check_approver(&needs, &req.action, &req.actor, req.approved_by.as_deref())?;
    let req = &Request {
        actor,
        ..req.clone()
    };
    let reason = match &remote_check {
        Some(c) => format!("{}: {} ({})", req.action.name(), req.reason, c.reference()),
        None => format!("{}: {}", req.action.name(), req.reason),
    };
    let reason = redact::truncate(&reason, 1000);
    apply(
        tx,
        schema,
        id,
        req,
        &steps,
        evidence.as_deref(),
        remote_check.as_ref(),
        &reason,
    )
    .await?;
    let audit_ref: i64 = sqlx::query_scalar(
        schema.sql("SELECT max(id) FROM {{schema}}.process_history WHERE process_id = $1"),
    )
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    let (row_version, status): (i64, ProcessStatus) = sqlx::query_as(
        schema.sql("SELECT row_version, status FROM {{schema}}.processes WHERE id = $1"),
    )
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    Ok(Outcome {
        audit_ref,
        row_version,
        status,
    })
}

/// Makes the change `req.action` asks for (already allowed and checked by [`act_in`]); its
/// transitions are recorded by the database triggers with `reason` and the actor.
#[allow(clippy::too_many_arguments)]
async fn apply(
    tx: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
    req: &Request,
    steps: &[StepView],
    evidence: Option<&str>,
    remote_check: Option<&RemoteCheck>,
    reason: &str,
) -> Result<(), Error> {
    let step = |seq: i32| steps.iter().find(|s| s.seq == seq);
    match &req.action {
        Action::Pause | Action::Resume => {
            sqlx::query(schema.sql(
                "UPDATE {{schema}}.processes SET paused = $2, last_reason = $3, last_actor = $4, updated_at = now(), \
                 next_run_at = CASE WHEN $2 THEN next_run_at ELSE now() END WHERE id = $1",
            ))
            .bind(id)
            .bind(matches!(req.action, Action::Pause))
            .bind(reason)
            .bind(&req.actor)
            .execute(&mut *tx)
            .await?;
        }
        Action::Escalate => {
            take_process(
                tx,
                schema,
                id,
                ProcessStatus::ManualReview,
                reason,
                &req.actor,
            )
            .await?
        }
        Action::Cancel => {
            take_process(tx, schema, id, ProcessStatus::Cancelled, reason, &req.actor).await?
        }
        Action::RerunStep { seq } | Action::RunCompensation { seq } => {
            // The step runs again (or its compensation runs), by a worker: forward or backward.
            set_step(
                tx,
                schema,
                id,
                *seq,
                StepStatus::Pending,
                None,
                reason,
                &req.actor,
            )
            .await?;
            let next = if matches!(req.action, Action::RunCompensation { .. }) {
                ProcessStatus::Compensating
            } else {
                ProcessStatus::Running
            };
            take_process(tx, schema, id, next, reason, &req.actor).await?;
        }
        Action::QueryRemote { seq } => {
            let waiting = step(*seq).is_some_and(StepView::is_waiting);
            query_remote(tx, schema, id, *seq, waiting, req, reason).await?;
        }
        Action::ResolveSucceeded { seq } | Action::ResolveFailed { seq } => {
            let s = step(*seq).ok_or_else(|| Error::Invalid(format!("no step {seq}")))?;
            resolve(tx, schema, id, req, s, evidence, remote_check, reason).await?;
        }
    }
    Ok(())
}

/// Asks the remote for step `seq`'s outcome now. A parked wait (`waiting`) gets its deadline
/// brought to now: the worker finds no event, so it queries the remote by the wait's key, as it
/// would have at the deadline. Any other step becomes an unknown outcome to check: the worker
/// treats a retryable step with an unknown outcome as in doubt and queries the remote by
/// operation id before any new call.
async fn query_remote(
    tx: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
    seq: i32,
    waiting: bool,
    req: &Request,
    reason: &str,
) -> Result<(), Error> {
    let change = if waiting {
        "UPDATE {{schema}}.process_steps SET wait_until = least(wait_until, now()), \
         next_attempt_at = CASE WHEN status = 'retryable' THEN now() ELSE next_attempt_at END, \
         last_reason = $3, last_actor = $4, updated_at = now() \
         WHERE process_id = $1 AND seq = $2"
    } else {
        "UPDATE {{schema}}.process_steps SET status = 'retryable', error_class = 'unknown', \
         next_attempt_at = now(), max_attempts = greatest(max_attempts, attempts + 1), \
         last_reason = $3, last_actor = $4, lease_token = 0, updated_at = now() \
         WHERE process_id = $1 AND seq = $2"
    };
    sqlx::query(schema.sql(change))
        .bind(id)
        .bind(seq)
        .bind(reason)
        .bind(&req.actor)
        .execute(&mut *tx)
        .await?;
    take_process(tx, schema, id, ProcessStatus::Running, reason, &req.actor).await
}

/// Resolves step `s` as `req.action` says: the decision is a step of its own (role
/// `resolution`, linked to `s`), `s` takes the outcome with its evidence, and the process goes
/// back to a worker, which continues, compensates or finishes.
#[allow(clippy::too_many_arguments)]
async fn resolve(
    tx: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
    req: &Request,
    s: &StepView,
    evidence: Option<&str>,
    remote_check: Option<&RemoteCheck>,
    reason: &str,
) -> Result<(), Error> {
    let seq = &s.seq;
    let succeeded = matches!(req.action, Action::ResolveSucceeded { .. });
    // The decision is a step of its own, linked to the step it resolves.
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.process_steps (process_id, seq, name, role, acts_on, execution, status, \
             operation_id, attempts, max_attempts, result_ref, finished_at, last_reason, last_actor, \
             first_attempt_at, last_attempt_at) \
         SELECT $1, max(seq) + 1, $3 || '#' || (max(seq) + 1), 'resolution', $2, 'operator', 'pending', \
                md5($1::text || '/resolution/' || (max(seq) + 1))::uuid, 0, 1, NULL, NULL, $5, $6, now(), now() \
         FROM {{schema}}.process_steps WHERE process_id = $1",
    ))
    .bind(id)
    .bind(seq)
    .bind(&s.name)
    .bind(evidence)
    .bind(reason)
    .bind(&req.actor)
    .execute(&mut *tx)
    .await?;
    let resolution: i32 = sqlx::query_scalar(
        schema.sql("SELECT max(seq) FROM {{schema}}.process_steps WHERE process_id = $1"),
    )
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    let done_ref = evidence
        .map(str::to_string)
        .or_else(|| remote_check.map(RemoteCheck::reference))
        .unwrap_or_else(|| format!("resolved failed by {}", req.actor));
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.process_steps SET status = 'succeeded', attempts = 1, result_ref = $3, \
         finished_at = now(), last_reason = $4, last_actor = $5, updated_at = now() \
         WHERE process_id = $1 AND seq = $2",
    ))
    .bind(id)
    .bind(resolution)
    .bind(redact::truncate(&done_ref, 500))
    .bind(reason)
    .bind(&req.actor)
    .execute(&mut *tx)
    .await?;
    let target = if succeeded {
        StepStatus::Succeeded
    } else {
        StepStatus::Failed
    };
    set_step(
        tx,
        schema,
        id,
        *seq,
        target,
        evidence.or(Some(&done_ref)),
        reason,
        &req.actor,
    )
    .await?;
    // The process goes back to a worker, which continues (or compensates, or finishes).
    let is_comp = s.role == "compensation";
    let next = match (is_comp, succeeded) {
        (false, _) => ProcessStatus::Running,
        (true, true) => ProcessStatus::Compensating,
        (true, false) => ProcessStatus::Failed,
    };
    take_process(tx, schema, id, next, reason, &req.actor).await?;
    Ok(())
}

async fn get_in(
    tx: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
) -> Result<(ProcessSummary, Vec<StepView>), Error> {
    let row = sqlx::query(schema.sql(&format!(
        "SELECT {PROCESS_COLUMNS} FROM {{{{schema}}}}.processes WHERE id = $1"
    )))
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    let p = ProcessSummary::from_row(&row)?;
    let steps = steps_of(tx, schema, id).await?;
    Ok((p, steps))
}

/// Moves the process to `status` and takes a new fencing token, so a worker still holding it
/// can write nothing more.
async fn take_process(
    tx: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
    status: ProcessStatus,
    reason: &str,
    actor: &str,
) -> Result<(), Error> {
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.processes SET status = $2, last_reason = $3, last_actor = $4, \
         lease_owner = NULL, lease_until = NULL, lease_token = nextval('{{schema}}.process_lease_tokens'), \
         next_run_at = now(), updated_at = now(), \
         finished_at = CASE WHEN $2 IN ('succeeded', 'failed', 'compensated', 'cancelled') THEN now() END \
         WHERE id = $1",
    ))
    .bind(id)
    .bind(status)
    .bind(reason)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn set_step(
    tx: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
    seq: i32,
    status: StepStatus,
    reference: Option<&str>,
    reason: &str,
    actor: &str,
) -> Result<(), Error> {
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.process_steps SET status = $3, \
         result_ref = CASE WHEN $3 = 'succeeded' THEN coalesce(result_ref, $4) ELSE result_ref END, \
         error_class = CASE WHEN $3 = 'failed' THEN coalesce(error_class, 'permanent') ELSE error_class END, \
         next_attempt_at = NULL, \
         max_attempts = CASE WHEN $3 = 'pending' THEN greatest(max_attempts, attempts + 1) ELSE max_attempts END, \
         finished_at = CASE WHEN $3 IN ('succeeded', 'failed') THEN now() END, \
         last_reason = $5, last_actor = $6, lease_token = 0, updated_at = now() \
         WHERE process_id = $1 AND seq = $2",
    ))
    .bind(id)
    .bind(seq)
    .bind(status)
    .bind(reference.map(|r| redact::truncate(r, 500)))
    .bind(reason)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::definition::Remote;

    #[test]
    fn every_action_kind_has_one_name_everywhere() {
        for k in ActionKind::ALL {
            assert_eq!(ActionKind::parse(k.name()), Some(k));
            assert_eq!(k.on(1).kind(), k);
            assert_eq!(k.on(1).name(), k.name());
            assert_eq!(serde_json::to_value(k).unwrap(), k.name());
            assert_eq!(serde_json::to_value(k.on(1)).unwrap()["action"], k.name());
            assert_eq!(k.on(1).seq().is_some(), k.on_step(), "{k}");
        }
        assert_eq!(ActionKind::parse("query_remote"), None);
    }

    use super::*;

    fn process(status: ProcessStatus) -> ProcessSummary {
        crate::decide::tests::process(status, false)
    }

    /// The charge step in manual review after two attempts: external on `remote`, else local.
    fn step(seq: i32, remote: Option<Remote>, class: Option<&str>) -> StepView {
        let execution = if remote.is_some() {
            "external"
        } else {
            "local"
        };
        StepView {
            name: "charge".into(),
            remote: remote.map(|r| r.as_str().to_string()),
            attempts: 2,
            max_attempts: 2,
            error_class: class.map(String::from),
            ..crate::decide::tests::view(
                seq,
                crate::definition::Role::Forward,
                execution,
                StepStatus::ManualReview,
            )
        }
    }

    fn waiting(seq: i32, remote: Remote, status: StepStatus) -> StepView {
        let now = Utc::now();
        StepView {
            execution: "wait".into(),
            status,
            error_class: None,
            wait_key: Some("charge:ch_1".into()),
            wait_since: Some(now),
            wait_until: Some(now + chrono::TimeDelta::minutes(5)),
            ..step(seq, Some(remote), None)
        }
    }

    /// A process parked on a wait: query now where the remote can be queried, and resolve either
    /// way only with the evidence and the second person a step in doubt needs (the call it waits
    /// on was made: the remote may have acted). A timer offers none of these.
    #[test]
    fn a_waiting_step_offers_query_now_and_guarded_resolutions() {
        let p = process(ProcessStatus::Waiting);
        for (remote, status) in [
            (Remote::Queryable, StepStatus::Running),
            (Remote::Queryable, StepStatus::Retryable),
            (Remote::Neither, StepStatus::Running),
        ] {
            let steps = [waiting(2, remote, status)];
            let allowed = allowed_actions(&p, &steps);
            let query = Action::QueryRemote { seq: 2 };
            assert_eq!(
                allowed.contains(&query),
                remote == Remote::Queryable,
                "{remote:?}: {allowed:?}"
            );
            assert!(allowed.contains(&Action::Cancel) && allowed.contains(&Action::Escalate));
            let d = doubts(&steps);
            assert_eq!(d.len(), 1);
            assert_eq!(
                d[0].safe_action,
                (remote == Remote::Queryable).then_some(query)
            );
            let failed = requirements(&Action::ResolveFailed { seq: 2 }, &steps);
            assert!(failed.remote_check && failed.second_person);
            let succeeded = requirements(&Action::ResolveSucceeded { seq: 2 }, &steps);
            assert!(succeeded.evidence && succeeded.second_person);
        }
        // The wait ended (the event came): nothing to decide on it.
        let done = [waiting(2, Remote::Queryable, StepStatus::Succeeded)];
        assert!(doubts(&done).is_empty());
        assert!(!allowed_actions(&p, &done).contains(&Action::ResolveFailed { seq: 2 }));
        // A timer is not in doubt.
        let timer = [StepView {
            execution: "timer".into(),
            remote: None,
            wait_key: None,
            ..waiting(2, Remote::Queryable, StepStatus::Running)
        }];
        assert!(doubts(&timer).is_empty());
        assert_eq!(
            allowed_actions(&p, &timer),
            vec![Action::Escalate, Action::Pause, Action::Cancel]
        );
    }

    /// For each remote capability, an unknown outcome names the doubt and its safe action, which
    /// comes first; resolving as failed then needs a remote check and a second person. Without the
    /// doubt (a permanent error), it needs neither.
    #[test]
    fn an_unknown_outcome_offers_the_safe_action_first_and_guards_resolve_failed() {
        let p = process(ProcessStatus::ManualReview);
        for (remote, safe) in [
            (Remote::HonoursKey, Some(Action::RerunStep { seq: 1 })),
            (Remote::Queryable, Some(Action::QueryRemote { seq: 1 })),
            (Remote::Neither, None),
        ] {
            let steps = [step(1, Some(remote), Some("unknown"))];
            let d = doubts(&steps);
            assert_eq!(d.len(), 1, "{remote:?}");
            assert_eq!(d[0].safe_action, safe, "{remote:?}");
            assert!(d[0].warning.contains("may have acted"));
            let allowed = allowed_actions(&p, &steps);
            if let Some(safe) = &safe {
                assert_eq!(allowed.first(), Some(safe), "{remote:?}: {allowed:?}");
            }
            let failed = Action::ResolveFailed { seq: 1 };
            let at = |a: &Action| allowed.iter().position(|x| x == a);
            assert!(at(&failed) > at(&Action::ResolveSucceeded { seq: 1 }));
            let needs = requirements(&failed, &steps);
            assert!(needs.remote_check && needs.second_person && !needs.evidence);
            assert!(check_evidence(&needs, None, None).is_err());
            assert!(check_approver(&needs, &failed, "alice", None).is_err());
            assert!(check_approver(&needs, &failed, "alice", Some(" alice ")).is_err());
            assert_eq!(
                check_approver(&needs, &failed, "alice", Some("bob")).ok(),
                Some("alice (approved by bob)".to_string())
            );
        }
        let steps = [step(1, Some(Remote::Neither), Some("permanent"))];
        assert!(doubts(&steps).is_empty());
        let needs = requirements(&Action::ResolveFailed { seq: 1 }, &steps);
        assert_eq!(needs, Requirements::default());
        let local = [step(1, None, Some("unknown"))];
        assert!(doubts(&local).is_empty(), "a local step is never in doubt");
    }
}
