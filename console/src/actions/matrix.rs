//! The role matrix: every action the console can be asked to do, and the least role each needs.
//! One place, one matrix; the web page, the API and the CLI all ask [`allowed`].
//!
//! Roles are ordered: `viewer < operator < approver < admin`, and each may do everything the roles
//! before it may. Every action names the least role it needs.

use crate::auth::roles::{Role, process_min_role};
use crate::targets::ordered::OrderedAction;
use crate::targets::processes::ConsoleWords;
use processes::admin::ActionKind;

/// Everything the console can be asked to do, reads included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Any read: lists, pages, the audit log, the idempotency lookup.
    Read,
    /// Put dead outbox rows back to pending (more than one: needs approval).
    OutboxRequeue,
    /// Re-inject consumer dead letters into the consumer's queue (more than one: needs approval).
    DlqReplay,
    /// Approve another person's request.
    ApprovalApprove,
    /// Reject another person's request.
    ApprovalReject,
    /// Delete audit entries older than the retention.
    AuditPurge,
    /// An action on a process, in the processes crate's vocabulary ([`ActionKind`]).
    Process(ActionKind),
    /// Hold a dependency's circuit open by hand (`true`: every call to the remote waits), or close
    /// it (`false`: calls go again, waiting work resumes).
    DependencyCircuit(bool),
    /// An action on an ordered consumer's stuck aggregate (see [`crate::targets::ordered`]): an operator
    /// retries, or asks for a skip or a dead-lettered run that an approver must approve.
    Ordered(OrderedAction),
}

impl Action {
    /// The decision on an approval request: approving it, or rejecting it.
    pub fn decision(approve: bool) -> Action {
        if approve {
            Action::ApprovalApprove
        } else {
            Action::ApprovalReject
        }
    }

    /// The action's name in the audit log, metrics and URLs.
    pub fn name(self) -> &'static str {
        match self {
            Action::Read => "read",
            Action::OutboxRequeue => "outbox.requeue",
            Action::DlqReplay => "dlq.replay",
            Action::ApprovalApprove => "approval.approve",
            Action::ApprovalReject => "approval.reject",
            Action::AuditPurge => "audit.purge",
            Action::DependencyCircuit(true) => "dependency.open",
            Action::DependencyCircuit(false) => "dependency.close",
            Action::Process(p) => p.audit_name(),
            Action::Ordered(o) => o.audit_name(),
        }
    }

    /// The least role that may perform the action.
    pub fn min_role(self) -> Role {
        match self {
            Action::Read => Role::Viewer,
            Action::OutboxRequeue | Action::DlqReplay | Action::DependencyCircuit(_) => {
                Role::Operator
            }
            Action::ApprovalApprove | Action::ApprovalReject => Role::Approver,
            Action::AuditPurge => Role::Admin,
            Action::Process(p) => process_min_role(p),
            Action::Ordered(_) => Role::Operator,
        }
    }

    /// Every action, for the role matrix (tests, docs).
    pub fn all() -> Vec<Action> {
        let mut v = vec![
            Action::Read,
            Action::OutboxRequeue,
            Action::DlqReplay,
            Action::ApprovalApprove,
            Action::ApprovalReject,
            Action::AuditPurge,
            Action::DependencyCircuit(true),
            Action::DependencyCircuit(false),
        ];
        v.extend(
            crate::targets::processes::OFFERED
                .iter()
                .map(|p| Action::Process(*p)),
        );
        v.extend(OrderedAction::ALL.iter().map(|o| Action::Ordered(*o)));
        v
    }
}

/// May `role` perform `action`?
pub fn allowed(role: Role, action: Action) -> bool {
    role >= action.min_role()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_is_monotonic_and_viewers_only_read() {
        for a in Action::all() {
            let mut seen_allowed = false;
            for r in Role::ALL {
                if seen_allowed {
                    assert!(
                        allowed(r, a),
                        "{r} may not {} but a lower role may",
                        a.name()
                    );
                }
                seen_allowed |= allowed(r, a);
            }
            assert!(allowed(Role::Admin, a));
            assert_eq!(allowed(Role::Viewer, a), a == Action::Read, "{}", a.name());
        }
    }
}
