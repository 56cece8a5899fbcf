//! Processes: what the console shows of them and the actions it offers, on the processes crate's
//! `admin` module ([`Admin`]).
//!
//! The processes crate decides which actions are allowed now (`admin::allowed_actions`, from the
//! process status, each step's status, error class and remote capability) and performs them
//! (`admin::act_in`, in the console's transaction, so the audit entry commits with the effect).
//! The console adds who may ask ([`crate::auth::roles::process_min_role`]) and the row
//! version check's answer (409). Which actions need a second person, evidence or a remote check
//! is the processes crate's rule (`admin::requirements`), so it holds below the console too: the
//! console turns such a request into an approval request.

use crate::error::ConsoleError;
use chrono::{DateTime, Utc};
use processes::admin::{self, Action as AdminAction, ActionKind};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// The process actions the console offers: every kind of the processes crate's vocabulary
/// ([`ActionKind`]) but `cancel`, which abandons a process without compensating its effects
/// (resolve_failed ends a manual review and compensates).
pub const OFFERED: [ActionKind; 8] = [
    ActionKind::RerunStep,
    ActionKind::QueryRemote,
    ActionKind::Escalate,
    ActionKind::Pause,
    ActionKind::Resume,
    ActionKind::RunCompensation,
    ActionKind::ResolveSucceeded,
    ActionKind::ResolveFailed,
];

/// The offered action named `name` in a URL (`/api/processes/{id}/actions/{name}`); `None` for
/// an unknown name and for `cancel`.
pub fn parse_action(name: &str) -> Option<ActionKind> {
    ActionKind::parse(name).filter(|k| OFFERED.contains(k))
}

/// What the console says of a process action besides its name: the audit log's name and the
/// button's label. A trait on the processes crate's [`ActionKind`], so the console keeps no
/// vocabulary of its own.
pub trait ConsoleWords {
    /// The name in the audit log and metrics (`process.<name>`).
    fn audit_name(self) -> &'static str;
    /// The button on the process page.
    fn label(self) -> &'static str;
}

impl ConsoleWords for ActionKind {
    fn audit_name(self) -> &'static str {
        match self {
            ActionKind::RerunStep => "process.rerun_step",
            ActionKind::QueryRemote => "process.query_remote_status",
            ActionKind::Escalate => "process.escalate",
            ActionKind::Pause => "process.pause",
            ActionKind::Resume => "process.resume",
            ActionKind::RunCompensation => "process.run_compensation",
            ActionKind::ResolveSucceeded => "process.resolve_succeeded",
            ActionKind::ResolveFailed => "process.resolve_failed",
            ActionKind::Cancel => "process.cancel",
        }
    }

    fn label(self) -> &'static str {
        match self {
            ActionKind::RerunStep => "Rerun step",
            ActionKind::QueryRemote => "Query remote status",
            ActionKind::Escalate => "Escalate to manual review",
            ActionKind::Pause => "Pause",
            ActionKind::Resume => "Resume",
            ActionKind::RunCompensation => "Request compensation",
            ActionKind::ResolveSucceeded => "Request resolve as succeeded",
            ActionKind::ResolveFailed => "Resolve as failed",
            ActionKind::Cancel => "Cancel",
        }
    }
}

/// An offered action's kind and step, of an action the processes crate allows; `None` for
/// `cancel`, which the console does not offer.
fn of_admin(a: &AdminAction) -> Option<(ActionKind, Option<i32>)> {
    let kind = a.kind();
    OFFERED.contains(&kind).then(|| (kind, a.seq()))
}

/// Filters of `GET /api/processes` (manual_review first, then most recently changed).
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
pub struct ProcessFilter {
    pub kind: Option<String>,
    pub status: Option<String>,
    /// Only processes created at least this many seconds ago.
    pub older_than_seconds: Option<i64>,
    /// At most this many (default 100).
    pub limit: Option<i64>,
}

/// What was checked at the remote and its answer (the processes crate's `admin::RemoteCheck`):
/// required to resolve as failed a step whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RemoteCheck {
    /// What was looked at: where, by which reference or operation id (1 to 240 bytes).
    pub checked: String,
    /// What the remote answered (1 to 240 bytes).
    pub answer: String,
}

impl ProcessFilter {
    /// No control character in any text filter (400).
    pub fn check(&self) -> Result<(), ConsoleError> {
        crate::text::check_all([
            ("kind", self.kind.as_deref()),
            ("status", self.status.as_deref()),
        ])
    }
}

/// Body of `POST /api/processes/{id}/actions/{action}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProcessActionRequest {
    pub reason: String,
    /// The process `version` the operator saw.
    pub version: i64,
    /// Evidence for resolve_succeeded (a provider reference, a ticket): required there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<String>,
    /// For resolve_failed on a step whose outcome is unknown (`unknown_outcomes`): required there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_check: Option<RemoteCheck>,
    /// The step (its `seq`) of a step action; may be left out when exactly one step offers it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<i32>,
}

/// An action checked against the process as it is now.
#[derive(Debug, Clone)]
pub struct Checked {
    /// The request with its step filled in (what an approval request stores).
    pub request: ProcessActionRequest,
    /// The process and the step acted on, as they are (the audit entry's `before`).
    pub before: Value,
    /// A second person must approve it (the processes crate's `admin::requirements`).
    pub needs_approval: bool,
}

/// The processes crate's `admin` module, on the product schema.
#[derive(Debug, Clone)]
pub struct Admin {
    pub schema: Schema,
}

impl Admin {
    pub fn new(schema: Schema) -> Self {
        Self { schema }
    }
}

/// The console's answer to an error of the processes crate.
fn error(e: processes::Error) -> ConsoleError {
    match e {
        processes::Error::NotFound(id) => ConsoleError::NotFound(format!("process {id}")),
        e @ (processes::Error::Stale { .. } | processes::Error::NotAllowed { .. }) => {
            ConsoleError::Conflict(e.to_string())
        }
        processes::Error::Invalid(why) => ConsoleError::BadRequest(why),
        // The console asks a second person first; reaching this is a refusal, audited as one.
        e @ processes::Error::NeedsSecondPerson { .. } => ConsoleError::Forbidden(e.to_string()),
        processes::Error::Database(e) => ConsoleError::Db(e),
        processes::Error::Input(e) => ConsoleError::Internal(format!("process input: {e}")),
    }
}

fn to_value<T: Serialize>(v: &T) -> Result<Value, ConsoleError> {
    serde_json::to_value(v).map_err(|e| ConsoleError::Internal(e.to_string()))
}

/// A summary as the console shows it: the processes crate's fields, `row_version` as `version`.
fn summary(p: &admin::ProcessSummary) -> Result<Value, ConsoleError> {
    let mut v = to_value(p)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("version".into(), json!(p.row_version));
    }
    Ok(v)
}

/// The last classified error of any step: the most recently attempted step that has one.
fn last_error(steps: &[admin::StepView]) -> Value {
    steps
        .iter()
        .filter(|s| s.error_class.is_some())
        .max_by_key(|s| (s.last_attempt_at.unwrap_or(DateTime::<Utc>::MIN_UTC), s.seq))
        .map(|s| {
            json!({
                "step": s.seq,
                "name": s.name,
                "role": s.role,
                "class": s.error_class,
                "message": s.error_message,
                "at": s.last_attempt_at,
            })
        })
        .unwrap_or(Value::Null)
}

/// The actions allowed now, as the console offers them (safe ones first, as the processes crate
/// orders them), with what each needs: a second approver, evidence, a remote check.
fn offered(v: &admin::ProcessView) -> Value {
    let safe: Vec<&AdminAction> = v
        .doubts
        .iter()
        .filter_map(|d| d.safe_action.as_ref())
        .collect();
    Value::Array(
        v.allowed
            .iter()
            .filter_map(|a| of_admin(a).map(|o| (a, o)))
            .map(|(a, (action, step))| {
                let needs = admin::requirements(a, &v.steps);
                json!({
                    "action": action.name(),
                    "step": step,
                    "min_role": crate::auth::roles::process_min_role(action),
                    "needs_approval": needs.second_person,
                    "needs_evidence": needs.evidence,
                    "needs_remote_check": needs.remote_check,
                    "safe_for_unknown_outcome": safe.contains(&a),
                })
            })
            .collect(),
    )
}

/// The steps whose outcome is unknown: the remote may have acted; the safe action first.
fn unknown_outcomes(v: &admin::ProcessView) -> Value {
    Value::Array(
        v.doubts
            .iter()
            .map(|d| {
                json!({
                    "step": d.seq,
                    "name": d.name,
                    "remote": d.remote,
                    "remote_may_have_acted": true,
                    "warning": d.warning,
                    "safe_action": d.safe_action.as_ref()
                        .and_then(of_admin)
                        .map(|(a, _)| a.name()),
                })
            })
            .collect(),
    )
}

fn view_json(v: &admin::ProcessView) -> Result<Value, ConsoleError> {
    let mut out = summary(&v.process)?;
    if let Some(o) = out.as_object_mut() {
        o.insert("input".into(), v.input.clone());
        o.insert("last_error".into(), last_error(&v.steps));
        o.insert("unknown_outcomes".into(), unknown_outcomes(v));
        o.insert("steps".into(), to_value(&v.steps)?);
        o.insert("history".into(), to_value(&v.history)?);
        o.insert("allowed_actions".into(), offered(v));
    }
    Ok(out)
}

/// The step `request` names, or the only step that offers `action` now.
fn resolve_step(
    view: &admin::ProcessView,
    action: ActionKind,
    request: &ProcessActionRequest,
) -> Result<AdminAction, ConsoleError> {
    let p = &view.process;
    if p.row_version != request.version {
        return Err(ConsoleError::Conflict(format!(
            "process {} changed since version {} (now {}); reload and decide again",
            p.id, request.version, p.row_version
        )));
    }
    let offered: Vec<Option<i32>> = view
        .allowed
        .iter()
        .filter_map(of_admin)
        .filter(|(a, _)| *a == action)
        .map(|(_, step)| step)
        .collect();
    let not_now = || {
        ConsoleError::Conflict(format!(
            "{} is not allowed now: process is {}{}",
            action.name(),
            p.status,
            if p.paused { " (paused)" } else { "" }
        ))
    };
    if !action.on_step() {
        return if offered.is_empty() {
            Err(not_now())
        } else {
            Ok(action.on(0))
        };
    }
    let step = match (request.step, offered.as_slice()) {
        (Some(s), _) => s,
        (None, [Some(only)]) => *only,
        (None, []) => return Err(not_now()),
        (None, many) => {
            let steps: Vec<String> = many.iter().flatten().map(|s| s.to_string()).collect();
            return Err(ConsoleError::BadRequest(format!(
                "{} is offered on steps {}: name one as \"step\"",
                action.name(),
                steps.join(", ")
            )));
        }
    };
    if !offered.contains(&Some(step)) {
        return Err(ConsoleError::Conflict(format!(
            "{} is not allowed now on step {step}",
            action.name()
        )));
    }
    Ok(action.on(step))
}

fn step_of(a: &AdminAction) -> Option<i32> {
    of_admin(a).and_then(|(_, step)| step)
}

/// The process and the step acted on, for the audit entry.
fn before(view: &admin::ProcessView, step: Option<i32>) -> Value {
    let step = step.and_then(|seq| view.steps.iter().find(|s| s.seq == seq));
    json!({
        "status": view.process.status,
        "paused": view.process.paused,
        "version": view.process.row_version,
        "step": step.map(|s| json!({
            "seq": s.seq, "name": s.name, "role": s.role, "status": s.status,
            "error_class": s.error_class, "attempts": s.attempts,
        })),
    })
}

/// A console user as the process history names them (the processes crate adds
/// ` (approved by <approver>)` to the actor of an approved action).
pub fn actor(user: &str) -> String {
    format!("console:{user}")
}

/// The request's remote check, as the processes crate takes it.
fn remote_check_of(request: &ProcessActionRequest) -> Option<admin::RemoteCheck> {
    request.remote_check.as_ref().map(|c| admin::RemoteCheck {
        checked: c.checked.clone(),
        answer: c.answer.clone(),
    })
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn truncate(s: &str, max: usize) -> String {
    processes::redact::truncate(s, max)
}

impl Admin {
    /// Processes matching `filter`, manual_review first (JSON objects; redacted by the console).
    pub async fn list(
        &self,
        pool: &PgPool,
        filter: &ProcessFilter,
    ) -> Result<Vec<Value>, ConsoleError> {
        {
            let f = admin::Filter {
                kind: filter.kind.clone().filter(|k| !k.is_empty()),
                status: filter.status.clone().filter(|s| !s.is_empty()),
                older_than_seconds: filter.older_than_seconds,
                limit: filter.limit,
            };
            admin::list(pool, &self.schema, &f)
                .await
                .map_err(error)?
                .iter()
                .map(summary)
                .collect()
        }
    }

    /// How many processes wait in manual review (the overview's count).
    pub async fn in_manual_review(&self, pool: &PgPool) -> Result<i64, ConsoleError> {
        admin::count(pool, &self.schema, "manual_review")
            .await
            .map_err(error)
    }

    /// One process: overall and per-step status, last classified error, attempts, operation ids,
    /// external references, history, its `version` and `allowed_actions` (the actions allowed
    /// now for its state, error class and remote capability, with their steps).
    pub async fn get(&self, pool: &PgPool, id: Uuid) -> Result<Option<Value>, ConsoleError> {
        {
            match admin::get(pool, &self.schema, id).await {
                Ok(v) => view_json(&v).map(Some),
                Err(processes::Error::NotFound(_)) => Ok(None),
                Err(e) => Err(error(e)),
            }
        }
    }

    /// Checks on `conn`, changing nothing, that `action` is allowed now on the version the
    /// request names (stale or not allowed: `Conflict`), and fills in its step.
    pub async fn check(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
        action: ActionKind,
        request: &ProcessActionRequest,
    ) -> Result<Checked, ConsoleError> {
        {
            let view = admin::view(conn, &self.schema, id).await.map_err(error)?;
            let a = resolve_step(&view, action, request)?;
            // The processes crate's own rules, now: an approved request must not fail on them
            // later.
            let needs = admin::requirements(&a, &view.steps);
            admin::check_evidence(
                &needs,
                request.evidence.as_deref(),
                remote_check_of(request).as_ref(),
            )
            .map_err(error)?;
            let mut request = request.clone();
            request.step = step_of(&a);
            Ok(Checked {
                before: before(&view, request.step),
                request,
                needs_approval: needs.second_person,
            })
        }
    }

    /// Performs `action` as console user `requester`, approved by console user `approver` where
    /// the processes crate needs a second person, on `conn` (the console's transaction, which also
    /// writes the audit entry, and commits both or neither). A stale version or an action not
    /// allowed now is `Conflict`, with nothing changed. Returns (before, after).
    pub async fn perform(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
        action: ActionKind,
        request: &ProcessActionRequest,
        requester: &str,
        approver: Option<&str>,
    ) -> Result<(Value, Value), ConsoleError> {
        {
            // Lock first, so `before` is what the action changes.
            sqlx::query(
                self.schema
                    .sql("SELECT 1 FROM {{schema}}.processes WHERE id = $1 FOR UPDATE"),
            )
            .bind(id)
            .execute(&mut *conn)
            .await?;
            let view = admin::view(conn, &self.schema, id).await.map_err(error)?;
            let a = resolve_step(&view, action, request)?;
            let before = before(&view, step_of(&a));
            let req = admin::Request {
                action: a.clone(),
                // The console's audit log keeps the whole reason; the process history a prefix.
                reason: truncate(request.reason.trim(), 900),
                seen_version: request.version,
                actor: truncate(&actor(requester), 200),
                evidence: request.evidence.clone(),
                remote_check: remote_check_of(request),
                approved_by: approver.map(|a| truncate(&actor(a), 200)),
            };
            let done = admin::act_in(conn, &self.schema, id, &req)
                .await
                .map_err(error)?;
            let step = step_of(&a).and_then(|seq| {
                view.steps
                    .iter()
                    .find(|s| s.seq == seq)
                    .map(|s| json!({"seq": s.seq, "name": s.name, "role": s.role}))
            });
            let after = json!({
                "process": id,
                "action": action.name(),
                "step": step,
                "status": done.status,
                "version": done.row_version,
                "history_ref": done.audit_ref,
            });
            Ok((before, after))
        }
    }
}
