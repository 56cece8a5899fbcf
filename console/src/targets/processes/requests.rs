//! What a client sends about processes: the list's filters and an action's request body.

use crate::error::ConsoleError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

/// Filters of `GET /api/processes` (manual_review first, then most recently changed).
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
pub struct ProcessFilter {
    pub kind: Option<String>,
    pub status: Option<String>,
    /// Only processes created at least this many seconds ago.
    pub older_than_seconds: Option<i64>,
    /// At most this many (default 100).
    pub limit: Option<i64>,
}

/// What was checked at the remote and its answer (the processes crate's `admin::RemoteCheck`):
/// required to resolve as failed a step whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RemoteCheck {
    /// What was looked at: where, by which reference or operation id (1 to 240 bytes).
    pub checked: String,
    /// What the remote answered (1 to 240 bytes).
    pub answer: String,
}

impl ProcessFilter {
    /// No control character in any text filter (400).
    pub fn check(&self) -> Result<(), ConsoleError> {
        crate::text::check_all([
            ("kind", self.kind.as_deref()),
            ("status", self.status.as_deref()),
        ])?;
        self.process_status().map(|_| ())
    }

    /// The status asked for (none for an empty one); a word that is no process status is a 400.
    pub fn process_status(&self) -> Result<Option<processes::ProcessStatus>, ConsoleError> {
        match self.status.as_deref().filter(|s| !s.is_empty()) {
            None => Ok(None),
            Some(s) => processes::ProcessStatus::parse(s).map(Some).ok_or_else(|| {
                ConsoleError::BadRequest(format!("status: no process status is called {s:?}"))
            }),
        }
    }
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
