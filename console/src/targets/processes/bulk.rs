//! Process actions by filter (issue 23, item 7): "rerun the charge of every process in manual
//! review whose charge's outcome is unknown on a key-honouring remote". A dry run lists the
//! processes the filter selects now, with their versions and whether the action is allowed on
//! each; a request freezes those (id, version) pairs in ONE approval request with one reason, and
//! its approval acts on exactly them, each through `admin::act_in` with its own rules. A process
//! whose version moved on since the request is skipped and reported, never acted on blindly.
//!
//! Only actions that need nothing per process are offered in bulk: rerun a step, query the
//! remote, escalate, pause, resume. Resolving (which needs evidence or a remote check of each
//! process) and compensating (a refund judged per process) are refused: a filter cannot supply a
//! person's evidence.

use super::{Admin, ProcessActionRequest, ProcessQuery, error};
use crate::error::ConsoleError;
use crate::targets::Change;
use processes::admin::{self, ActionKind};
use processes::find::Query;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};
use utoipa::ToSchema;
use uuid::Uuid;

/// The actions offered in bulk: those allowed without per-process evidence or judgement.
pub const BULK_OFFERED: [ActionKind; 5] = [
    ActionKind::RerunStep,
    ActionKind::QueryRemote,
    ActionKind::Escalate,
    ActionKind::Pause,
    ActionKind::Resume,
];

/// Body of `POST /api/processes/actions/{action}`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct BulkRequest {
    /// The processes: the same filters as `GET /api/processes` (`after` and `limit` are ignored).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub filter: ProcessQuery,
    /// The step a step action acts on, by name (`charge`): required for rerun_step and
    /// query_remote_status; it also filters (the step is open).
    #[serde(default)]
    pub step: Option<String>,
    pub reason: String,
    /// List what the request would select and change nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// A process as a bulk request freezes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Frozen {
    pub id: Uuid,
    /// The process version when the request was made: the approval acts only on this one.
    pub version: i64,
}

/// What an approval of a bulk request runs: `action` (on the step named `step`) on exactly
/// `items`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BulkPending {
    pub action: ActionKind,
    pub step: Option<String>,
    /// The filter as asked (shown to the approver; not run again).
    pub filter: ProcessQuery,
    pub items: Vec<Frozen>,
}

/// The name of a bulk action in the approvals and the audit log (`processes.<action>`, plural:
/// one request over many processes).
pub fn bulk_audit_name(action: ActionKind) -> &'static str {
    match action {
        ActionKind::RerunStep => "processes.rerun_step",
        ActionKind::QueryRemote => "processes.query_remote_status",
        ActionKind::Escalate => "processes.escalate",
        ActionKind::Pause => "processes.pause",
        ActionKind::Resume => "processes.resume",
        // Not offered in bulk (bulk_query refuses them); named for completeness.
        ActionKind::RunCompensation => "processes.run_compensation",
        ActionKind::ResolveSucceeded => "processes.resolve_succeeded",
        ActionKind::ResolveFailed => "processes.resolve_failed",
        ActionKind::Cancel => "processes.cancel",
    }
}

/// The query a bulk request selects with, and its step; a request that is none is a 400.
pub fn bulk_query(action: ActionKind, r: &BulkRequest) -> Result<Query, ConsoleError> {
    if !BULK_OFFERED.contains(&action) {
        return Err(ConsoleError::BadRequest(format!(
            "{} is not offered in bulk: it needs evidence or a decision for each process \
             (offered: rerun_step, query_remote_status, escalate, pause, resume)",
            action.name()
        )));
    }
    crate::text::check_all([("step", r.step.as_deref())])?;
    let mut q = r.filter.check()?;
    q.after = None;
    q.limit = None;
    let step = r.step.as_deref().map(str::trim).filter(|s| !s.is_empty());
    match (action.on_step(), step, q.step.as_deref()) {
        (true, None, _) => Err(ConsoleError::BadRequest(format!(
            "{} acts on a step: name it (`step`)",
            action.name()
        ))),
        (true, Some(s), Some(f)) if s != f => Err(ConsoleError::BadRequest(format!(
            "step {s:?} and the filter's step {f:?} differ"
        ))),
        (true, Some(s), _) => {
            q.step = Some(s.to_string());
            Ok(q)
        }
        (false, _, _) => Ok(q),
    }
}

/// The seq of the forward step named `name` of process `id`, if it has one.
async fn seq_of(
    conn: &mut PgConnection,
    admin: &Admin,
    id: Uuid,
    name: &str,
) -> Result<Option<i32>, ConsoleError> {
    let view = admin::view(conn, &admin.schema, id).await.map_err(error)?;
    Ok(view
        .steps
        .iter()
        .find(|s| s.name == name && s.role == "forward")
        .map(|s| s.seq))
}

impl Admin {
    /// What a bulk request would select now: every matching process with its version, whether
    /// `action` is allowed on it now, and why not. The ones allowed are what a request freezes.
    pub async fn plan_bulk(
        &self,
        pool: &PgPool,
        query: &Query,
        action: ActionKind,
    ) -> Result<Vec<Value>, ConsoleError> {
        let selected = self.matching(pool, query).await?;
        let mut conn = pool.acquire().await?;
        let mut out = Vec::with_capacity(selected.len());
        for s in selected {
            let view = admin::view(&mut conn, &self.schema, s.id)
                .await
                .map_err(error)?;
            let seq = match &query.step {
                Some(n) if action.on_step() => view
                    .steps
                    .iter()
                    .find(|st| &st.name == n && st.role == "forward")
                    .map(|st| st.seq),
                _ => Some(0),
            };
            let allowed = seq.is_some_and(|seq| view.allowed.contains(&action.on(seq)));
            out.push(json!({
                "id": s.id,
                "version": s.version,
                "status": view.process.status,
                "business_key": view.process.business_key,
                "allowed": allowed,
                "why_not": if allowed { Value::Null } else {
                    json!(format!("{} is not allowed now: process is {}", action.name(), view.process.status))
                },
            }));
        }
        Ok(out)
    }

    /// Runs an approved bulk request on `conn`: `action` on each frozen process at its frozen
    /// version, each in a savepoint of its own, as `requester` approved by `approver`. A process
    /// that moved on (or no longer allows the action) is skipped and reported; the others are
    /// done. Returns the audit entries (one per process done) and the result.
    pub async fn run_bulk(
        &self,
        conn: &mut PgConnection,
        pending: &BulkPending,
        reason: &str,
        requester: &str,
        approver: &str,
    ) -> Result<(Vec<Change>, Value), ConsoleError> {
        let (mut changes, mut done, mut skipped) = (Vec::new(), Vec::new(), Vec::new());
        for item in &pending.items {
            let mut sp = conn.begin().await?;
            let step = match &pending.step {
                Some(n) => seq_of(&mut sp, self, item.id, n).await?,
                None => None,
            };
            let request = ProcessActionRequest {
                reason: reason.to_string(),
                version: item.version,
                evidence: None,
                remote_check: None,
                step,
            };
            let performed = self
                .perform(
                    &mut sp,
                    item.id,
                    pending.action,
                    &request,
                    requester,
                    Some(approver),
                )
                .await;
            match performed {
                Ok((before, after)) => {
                    sp.commit().await?;
                    done.push(
                        json!({"id": item.id, "version": item.version, "now": after["version"]}),
                    );
                    changes.push(Change::process(item.id, before, after));
                }
                Err(
                    ConsoleError::Conflict(why)
                    | ConsoleError::NotFound(why)
                    | ConsoleError::BadRequest(why),
                ) => {
                    sp.rollback().await?;
                    skipped.push(json!({"id": item.id, "version": item.version, "why": why}));
                }
                Err(e) => return Err(e),
            }
        }
        let result = json!({"action": pending.action.name(), "step": pending.step, "done": done, "skipped": skipped});
        Ok((changes, result))
    }
}
