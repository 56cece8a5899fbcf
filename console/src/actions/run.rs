//! How every action runs, whatever asked for it (API, web form, CLI through the API):
//!
//! 1. the role matrix ([`crate::actions::matrix::allowed`]); a refusal is audited (`denied`) and answers 403;
//! 2. one transaction: the effect runs and its audit entries are appended. With an
//!    Idempotency-Key the transaction is the idempotency layer's ([`crate::auth::keys`]): the key was
//!    reserved before, and the layer stores the response in the same transaction and commits it
//!    (a repeat replays the stored response). Without one, the console's own. Effect and audit
//!    commit together or not at all;
//! 3. a stale row version (409) or a four-eyes refusal (403) rolls the effect back; only its
//!    audit entry commits, on its own, and the key is released: nothing else changes.

use crate::actions::audit::{self, NewEntry, outcome};
use crate::actions::{Action, Caller, allowed};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::internal_events;
use crate::state::AppState;
use crate::targets::Change;
use axum::http::StatusCode;
use futures::future::BoxFuture;
use serde_json::Value;
use sqlx::PgConnection;

/// What an effect did.
#[derive(Debug)]
pub struct Effect {
    pub status: StatusCode,
    pub body: Value,
    pub changes: Vec<Change>,
}

impl Effect {
    /// An effect that ran now: 200 with `body`, audited as `changes`.
    pub fn ok(changes: Vec<Change>, body: Value) -> Self {
        Self {
            status: StatusCode::OK,
            body,
            changes,
        }
    }
}

/// What an effect runs with: the action's transaction, and who asks it, on what and why (an
/// approval request it creates names them, see [`crate::actions::approvals::create`]).
pub struct Acting<'c> {
    pub conn: &'c mut PgConnection,
    pub state: &'c AppState,
    pub principal: &'c Principal,
    pub target: &'c str,
    pub reason: &'c str,
}

/// The answer to an action.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub status: StatusCode,
    /// JSON text.
    pub body: String,
}

/// An action request.
struct Request<'a> {
    principal: &'a Principal,
    action: Action,
    target: String,
    reason: String,
    /// The idempotency layer's effect, when the request carried an Idempotency-Key.
    keyed: Option<&'a idempotency::Effect>,
}

/// Checks the role matrix; a refusal is audited and returned as 403.
pub async fn authorize(
    state: &AppState,
    principal: &Principal,
    action: Action,
    target: &str,
    reason: &str,
) -> Result<(), ConsoleError> {
    if allowed(principal.role, action) {
        return Ok(());
    }
    let why = format!(
        "{} may not {} (needs {})",
        principal.role,
        action.name(),
        action.min_role()
    );
    Err(deny(state, principal, action.name(), target, reason, why).await)
}

/// Records a denied attempt in its own transaction; returns the 403 to answer.
pub async fn deny(
    state: &AppState,
    principal: &Principal,
    action: &str,
    target: &str,
    reason: &str,
    why: String,
) -> ConsoleError {
    let entry = NewEntry {
        actor: principal.clone(),
        action: action.to_string(),
        target: target.to_string(),
        reason: reason.to_string(),
        approval_id: None,
        approver: None,
        before: None,
        after: Some(serde_json::json!({ "denied": why })),
        outcome: outcome::DENIED,
    };
    let written = async {
        let mut conn = state.pool.acquire().await?;
        audit::record(&mut conn, &state.schema, &entry).await
    }
    .await;
    if let Err(e) = written {
        return e;
    }
    internal_events::action(principal, action, target, outcome::DENIED);
    ConsoleError::Forbidden(why)
}

/// The reason every action needs.
pub fn require_reason(reason: &str) -> Result<String, ConsoleError> {
    let r = reason.trim();
    if r.is_empty() {
        return Err(ConsoleError::BadRequest("a reason is required".into()));
    }
    crate::text::check("reason", r)?;
    if r.len() > 2000 {
        return Err(ConsoleError::BadRequest(
            "the reason is at most 2000 bytes".into(),
        ));
    }
    Ok(r.to_string())
}

/// Runs `effect` as `action` of `call` on `target` for `reason` (see the module documentation).
pub async fn perform<F>(
    call: &Caller,
    action: Action,
    target: String,
    reason: String,
    effect: F,
) -> Result<Outcome, ConsoleError>
where
    F: for<'c> FnOnce(Acting<'c>) -> BoxFuture<'c, Result<Effect, ConsoleError>>,
{
    let state = &call.state;
    let req = Request {
        principal: &call.principal,
        action,
        target,
        reason,
        keyed: call.keyed.as_ref(),
    };
    authorize(state, req.principal, req.action, &req.target, &req.reason).await?;
    let name = req.action.name();
    let result = match req.keyed {
        // The layer commits this transaction with the stored response (or rolls it back).
        Some(keyed) => {
            let mut tx = keyed.tx().await?;
            apply(state, &req, &mut tx, effect).await
        }
        None => {
            let mut tx = state.pool.begin().await?;
            match apply(state, &req, &mut tx, effect).await {
                Ok(done) => {
                    tx.commit().await?;
                    Ok(done)
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    Err(e)
                }
            }
        }
    };
    match result {
        Ok(done) => {
            for c in &done.changes {
                internal_events::action(
                    c.actor.as_ref().unwrap_or(req.principal),
                    c.action.as_deref().unwrap_or(name),
                    &c.target,
                    c.outcome.unwrap_or(outcome::SUCCEEDED),
                );
            }
            Ok(Outcome {
                status: done.status,
                body: done.body.to_string(),
            })
        }
        Err(ConsoleError::Forbidden(why)) => {
            Err(deny(state, req.principal, name, &req.target, &req.reason, why).await)
        }
        Err(ConsoleError::Conflict(why)) => {
            let change = Change {
                target: req.target.clone(),
                after: Some(serde_json::json!({ "conflict": why })),
                outcome: Some(outcome::CONFLICT),
                ..Default::default()
            };
            let mut tx = state.pool.begin().await?;
            audit::record(&mut tx, &state.schema, &entry(&req, &change)).await?;
            tx.commit().await?;
            internal_events::action(req.principal, name, &req.target, outcome::CONFLICT);
            Err(ConsoleError::Conflict(why))
        }
        Err(other) => {
            internal_events::action(req.principal, name, &req.target, "failed");
            Err(other)
        }
    }
}

/// The effect and its audit entries, on `conn`.
async fn apply<F>(
    state: &AppState,
    req: &Request<'_>,
    conn: &mut PgConnection,
    effect: F,
) -> Result<Effect, ConsoleError>
where
    F: for<'c> FnOnce(Acting<'c>) -> BoxFuture<'c, Result<Effect, ConsoleError>>,
{
    let done = effect(Acting {
        conn: &mut *conn,
        state,
        principal: req.principal,
        target: &req.target,
        reason: &req.reason,
    })
    .await?;
    for c in &done.changes {
        audit::record(conn, &state.schema, &entry(req, c)).await?;
    }
    Ok(done)
}

fn entry(req: &Request<'_>, c: &Change) -> NewEntry {
    NewEntry {
        actor: c.actor.clone().unwrap_or_else(|| req.principal.clone()),
        action: c
            .action
            .clone()
            .unwrap_or_else(|| req.action.name().to_string()),
        target: c.target.clone(),
        reason: c.reason.clone().unwrap_or_else(|| req.reason.clone()),
        approval_id: c.approval_id,
        approver: c.approver.clone(),
        before: c.before.clone(),
        after: c.after.clone(),
        outcome: c.outcome.unwrap_or(outcome::SUCCEEDED),
    }
}
