//! Roles: who a user is to the console, and the least role each kind of process action needs.
//! The matrix of every action ([`crate::actions::allowed`]) is built on these.
//!
//! Roles are ordered: `viewer < operator < approver < admin`, and each may do everything the roles
//! before it may. Every action names the least role it needs.

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

/// Who may ask for a process action. Operator: the reversible actions, and requesting a
/// compensation (a refund), which runs only once an approver approves it. Approver: resolving a
/// manual review (as failed: now; as succeeded: once a second approver approves). `cancel`, which
/// the console does not offer: admin.
pub fn process_min_role(kind: ActionKind) -> Role {
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
    fn roles_parse_by_name() {
        assert_eq!("approver".parse::<Role>().unwrap(), Role::Approver);
        assert!("root".parse::<Role>().is_err());
    }
}
