//! Roles and actions: who may do what. One place, one matrix; the web page, the API and the CLI
//! all ask [`allowed`].
//!
//! Roles are ordered: `viewer < operator < approver < admin`, and each may do everything the roles
//! before it may. Every action names the least role it needs.

use crate::ordered::OrderedAction;
use processes::admin::ActionKind;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use utoipa::ToSchema;

/// A user's role.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything, redacted.
    Viewer,
    /// Single-item repairs, the reversible process actions, and requests that an approver
    /// confirms (bulk repairs, compensations such as refunds).
    Operator,
    /// Approving requests of others (which runs compensations), resolving manual reviews.
    Approver,
    /// Users, roles and audit retention.
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Viewer, Role::Operator, Role::Approver, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Approver => "approver",
            Role::Admin => "admin",
        }
    }

    /// The roles this role holds (itself and the ones below it), as the audit log records them.
    pub fn held(self) -> Vec<String> {
        Role::ALL
            .iter()
            .filter(|r| **r <= self)
            .map(|r| r.as_str().to_string())
            .collect()
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a role name was refused.
#[derive(Debug, thiserror::Error)]
#[error("unknown role {0:?}: use viewer, operator, approver or admin")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownRole(s.to_string()))
    }
}

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
    /// An action on an ordered consumer's stuck aggregate (see [`crate::ordered`]): an operator
    /// retries, or asks for a skip or a dead-lettered run that an approver must approve.
    Ordered(OrderedAction),
}

impl Action {
    /// The action's name in the audit log, metrics and URLs.
    pub fn name(self) -> &'static str {
        match self {
            Action::Read => "read",
            Action::OutboxRequeue => "outbox.requeue",
            Action::DlqReplay => "dlq.replay",
            Action::ApprovalApprove => "approval.approve",
            Action::ApprovalReject => "approval.reject",
            Action::AuditPurge => "audit.purge",
            Action::Process(p) => crate::processes::ConsoleWords::audit_name(p),
            Action::Ordered(o) => o.audit_name(),
        }
    }

    /// The least role that may perform the action.
    pub fn min_role(self) -> Role {
        match self {
            Action::Read => Role::Viewer,
            Action::OutboxRequeue | Action::DlqReplay => Role::Operator,
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
        ];
        v.extend(
            crate::processes::OFFERED
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

/// Who may ask for a process action. Operator: the reversible actions, and requesting a
/// compensation (a refund), which runs only once an approver approves it. Approver: resolving a
/// manual review (as failed: now; as succeeded: once a second approver approves). `cancel`, which
/// the console does not offer: admin.
fn process_min_role(kind: ActionKind) -> Role {
    match kind {
        ActionKind::RerunStep
        | ActionKind::QueryRemote
        | ActionKind::Escalate
        | ActionKind::Pause
        | ActionKind::Resume
        | ActionKind::RunCompensation => Role::Operator,
        ActionKind::ResolveSucceeded | ActionKind::ResolveFailed => Role::Approver,
        ActionKind::Cancel => Role::Admin,
    }
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
        assert_eq!("approver".parse::<Role>().unwrap(), Role::Approver);
        assert!("root".parse::<Role>().is_err());
    }
}
