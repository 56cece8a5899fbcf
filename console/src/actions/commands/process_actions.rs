//! Actions on a process: the sensitive ones ask an approver.

use crate::actions::Action;
use crate::actions::approvals::{self, Pending};
use crate::actions::{self, Caller, Effect, Outcome};
use crate::error::ConsoleError;
use crate::targets::processes::ProcessActionRequest;
use processes::admin::ActionKind;
use uuid::Uuid;

/// An action on a process: the sensitive ones create an approval request (after checking that the
/// action is allowed now on the version seen), the others run now.
pub async fn process_action(
    call: &Caller,
    id: Uuid,
    action: ActionKind,
    request: ProcessActionRequest,
) -> Result<Outcome, ConsoleError> {
    let target = format!("process:{id}");
    let act = Action::Process(action);
    call.authorize(act, &target, &request.reason).await?;
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
    actions::perform(call, act, target, reason, move |mut on| {
        Box::pin(async move {
            let backend = &on.state.processes;
            let checked = backend.check(on.conn, id, action, &request).await?;
            if checked.needs_approval {
                let pending = Pending::Process {
                    id,
                    action,
                    request: checked.request,
                };
                let mut requested = approvals::create(&mut on, &pending).await?;
                requested.change.before = Some(checked.before);
                Ok(requested.effect())
            } else {
                let (before, after) = backend
                    .perform(on.conn, id, action, &request, &on.principal.name, None)
                    .await?;
                // The process moved on: requests on the version it had are closed with it.
                approvals::supersede_stale(on.conn, on.state).await?;
                Ok(Effect::ok(
                    vec![crate::targets::Change::process(id, before, after.clone())],
                    after,
                ))
            }
        })
    })
    .await
}
