//! Requeueing dead outbox rows: one runs now, more than one asks an approver.

use super::{read, targets};
use crate::actions::Action;
use crate::actions::approvals::{self, Pending};
use crate::actions::{self, Effect, Outcome, Request};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::outbox_dead;
use serde_json::json;

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
    let req = Request {
        principal,
        action: Action::OutboxRequeue,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |mut on| {
        Box::pin(async move {
            let schema = &on.state.schema;
            if items.len() == 1 {
                let (changes, body) = outbox_dead::requeue(on.conn, schema, &items).await?;
                Ok(Effect::ok(changes, body))
            } else {
                outbox_dead::check(on.conn, schema, &items, false).await?;
                let pending = Pending::OutboxRequeue { items };
                Ok(approvals::create(&mut on, &pending).await?.effect())
            }
        })
    })
    .await
}
