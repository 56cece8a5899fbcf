//! Deciding an approval request: approving runs its effect, rejecting runs nothing.

use crate::actions::Action;
use crate::actions::approvals::{self, Decision};
use crate::actions::{self, Effect, Outcome, Request};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;
use uuid::Uuid;

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
    let req = Request {
        principal,
        action,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |on| {
        Box::pin(async move {
            let (changes, body) =
                approvals::decide(on.conn, on.state, on.principal, id, &decision, approve).await?;
            Ok(Effect::ok(changes, body))
        })
    })
    .await
}
