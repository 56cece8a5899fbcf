//! What a client sends about an action on a process: its request body (the list's query is
//! [`super::ProcessQuery`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// What was checked at the remote and its answer (the processes crate's `admin::RemoteCheck`):
/// required to resolve as failed a step whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RemoteCheck {
    /// What was looked at: where, by which reference or operation id (1 to 240 bytes).
    pub checked: String,
    /// What the remote answered (1 to 240 bytes).
    pub answer: String,
}

/// Body of `POST /api/processes/{id}/actions/{action}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProcessActionRequest {
    pub reason: String,
    /// The process `version` the operator saw.
    pub version: i64,
    /// Evidence for resolve_succeeded (a provider reference, a ticket): required there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<String>,
    /// For resolve_failed on a step whose outcome is unknown (`unknown_outcomes`): required there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_check: Option<RemoteCheck>,
    /// The step (its `seq`) of a step action; may be left out when exactly one step offers it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<i32>,
}

/// An action checked against the process as it is now.
#[derive(Debug, Clone)]
pub struct Checked {
    /// The request with its step filled in (what an approval request stores).
    pub request: ProcessActionRequest,
    /// The process and the step acted on, as they are (the audit entry's `before`).
    pub before: Value,
    /// A second person must approve it (the processes crate's `admin::requirements`).
    pub needs_approval: bool,
}
