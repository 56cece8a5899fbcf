//! [`Change`]: what an effect on a target did, as its audit entry will say. The targets produce
//! them; the actions layer ([`crate::actions::perform`]) appends them to the audit log in the
//! effect's transaction.

use crate::auth::users::Principal;
use serde_json::Value;
use uuid::Uuid;

/// One audit entry an effect produced (the actor, action and reason default to the request's).
#[derive(Debug, Clone, Default)]
pub struct Change {
    pub target: String,
    pub before: Option<Value>,
    pub after: Option<Value>,
    /// Default: `succeeded`.
    pub outcome: Option<&'static str>,
    pub approval_id: Option<Uuid>,
    pub approver: Option<String>,
    /// Who the entry is about when not the request's actor (the requester of an approved effect).
    pub actor: Option<Principal>,
    pub action: Option<String>,
    pub reason: Option<String>,
}

impl Change {
    /// The audit entry of an action on process `id`: its state before and after.
    pub fn process(id: Uuid, before: Value, after: Value) -> Self {
        Self {
            target: format!("process:{id}"),
            before: Some(before),
            after: Some(after),
            ..Default::default()
        }
    }
}
