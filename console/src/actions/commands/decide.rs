//! Deciding an approval request: approving runs its effect, rejecting runs nothing.

use crate::actions::Action;
use crate::actions::approvals::{self, Decision};
use crate::actions::{self, Caller, Effect, Outcome};
use crate::error::ConsoleError;
use uuid::Uuid;

/// Approve or reject an approval request.
pub async fn decide(
    call: &Caller,
    id: Uuid,
    decision: Decision,
    approve: bool,
) -> Result<Outcome, ConsoleError> {
    let action = Action::decision(approve);
    let target = format!("approval:{id}");
    call.authorize(action, &target, &decision.reason).await?;
    let reason = actions::require_reason(&decision.reason)?;
    // Requests whose process moved on are closed as superseded for good (committed on their own:
    // the decision below then answers 409 and rolls back).
    let state = &call.state;
    approvals::supersede_stale(&mut *state.pool.acquire().await?, state).await?;
    actions::perform(call, action, target, reason, move |on| {
        Box::pin(async move {
            let (changes, body) =
                approvals::decide(on.conn, on.state, on.principal, id, &decision, approve).await?;
            Ok(Effect::ok(changes, body))
        })
    })
    .await
}
