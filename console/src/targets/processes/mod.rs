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

mod bulk;
mod find;
mod requests;
mod rules;
mod view;
mod words;

pub use bulk::{BULK_OFFERED, BulkPending, BulkRequest, Frozen, bulk_audit_name, bulk_query};
pub use find::ProcessQuery;
pub use requests::{Checked, ProcessActionRequest, RemoteCheck};
pub use words::{ConsoleWords, OFFERED, parse_action};

use rules::{before, resolve_step, step_of};
use view::view_json;

use crate::error::ConsoleError;
use processes::admin::{self, ActionKind};
use serde_json::{Value, json};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

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
            admin::lock(conn, &self.schema, id).await.map_err(error)?;
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
