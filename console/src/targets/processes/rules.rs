//! The console's checks of an action request against the process as it is: the version seen,
//! the step named (or the only one offering it), and the state the audit entry keeps.

use super::ProcessActionRequest;
use super::words::of_admin;
use crate::error::ConsoleError;
use processes::admin::{self, Action as AdminAction, ActionKind};
use serde_json::{Value, json};

/// The step `request` names, or the only step that offers `action` now.
pub(super) fn resolve_step(
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

/// The step an offered action acts on, if any.
pub(super) fn step_of(a: &AdminAction) -> Option<i32> {
    of_admin(a).and_then(|(_, step)| step)
}

/// The process and the step acted on, for the audit entry.
pub(super) fn before(view: &admin::ProcessView, step: Option<i32>) -> Value {
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
