//! The console's words for the processes crate's action vocabulary ([`ActionKind`]): which
//! kinds it offers, how it names them in the audit log and on buttons.

use processes::admin::{Action as AdminAction, ActionKind};

/// The process actions the console offers: every kind of the processes crate's vocabulary
/// ([`ActionKind::ALL`]) but `cancel`, which abandons a process without compensating its effects
/// (resolve_failed ends a manual review and compensates).
pub const OFFERED: [ActionKind; 8] = but_cancel();

/// [`ActionKind::ALL`] without `cancel`, in its order (a vocabulary with another kind, or one
/// fewer, does not compile: the array's length no longer fits).
const fn but_cancel() -> [ActionKind; 8] {
    let mut offered = [ActionKind::Cancel; 8];
    let (mut i, mut n) = (0, 0);
    while i < ActionKind::ALL.len() {
        if !matches!(ActionKind::ALL[i], ActionKind::Cancel) {
            offered[n] = ActionKind::ALL[i];
            n += 1;
        }
        i += 1;
    }
    assert!(n == offered.len(), "ActionKind::ALL has 8 kinds but cancel");
    offered
}

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
pub(super) fn of_admin(a: &AdminAction) -> Option<(ActionKind, Option<i32>)> {
    let kind = a.kind();
    OFFERED.contains(&kind).then(|| (kind, a.seq()))
}
