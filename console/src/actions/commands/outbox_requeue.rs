//! Requeueing dead outbox rows: one runs now, more than one asks an approver.

use super::{read, targets};
use crate::actions::Action;
use crate::actions::approvals::{self, Pending};
use crate::actions::{self, Caller, Effect, Outcome};
use crate::error::ConsoleError;
use crate::targets::outbox_dead;
use serde_json::json;

/// Requeue dead outbox rows: one runs now, more than one creates an approval request, a dry run
/// says what each would do.
pub async fn requeue_outbox(
    call: &Caller,
    items: Vec<outbox_dead::Item>,
    reason: &str,
    dry_run: bool,
) -> Result<Outcome, ConsoleError> {
    let target = targets("outbox:", &items, |i| i.id.to_string());
    if dry_run {
        call.authorize(Action::OutboxRequeue, &target, reason)
            .await?;
        let mut conn = call.state.pool.acquire().await?;
        let plan = outbox_dead::plan(&mut conn, &call.state.schema, &items).await?;
        return Ok(read(
            json!({"dry_run": true, "needs_approval": items.len() > 1, "items": plan}),
        ));
    }
    let reason = match actions::require_reason(reason) {
        Ok(r) => r,
        Err(e) => {
            call.authorize(Action::OutboxRequeue, &target, reason)
                .await?;
            return Err(e);
        }
    };
    if items.is_empty() {
        call.authorize(Action::OutboxRequeue, &target, &reason)
            .await?;
        return Err(ConsoleError::BadRequest("no rows given".into()));
    }
    actions::perform(
        call,
        Action::OutboxRequeue,
        target,
        reason,
        move |mut on| {
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
        },
    )
    .await
}
