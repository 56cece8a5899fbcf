//! What the console does: the role matrix ([`matrix`]), who asks for an action ([`caller`]: state,
//! principal, Idempotency-Key), how every action runs ([`run`]: role check, effect and audit
//! entries in one transaction), the actions themselves ([`commands`]),
//! four eyes ([`approvals`]) and the append-only audit log ([`audit`]). Effects on the targets
//! come from [`crate::targets`].

pub mod approvals;
pub mod audit;
pub mod audit_page;
pub mod caller;
pub mod commands;
pub mod matrix;
pub mod run;

pub use caller::Caller;
pub use matrix::{Action, allowed};
pub use run::{Acting, Effect, Outcome, authorize, deny, perform, require_reason};
