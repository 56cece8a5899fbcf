//! Processes (issue 12): the seam where the `processes` crate plugs in.
//!
//! SEAM(processes crate): the lead implements [`ProcessBackend`] on the processes crate's `admin`
//! module (list/get, the actions allowed now, and performing one in the caller's transaction) and
//! sets `AppState::processes`. Until then the routes answer 501, after the role check (so the role
//! matrix and its audit of refusals already hold for every process action).
//!
//! The roles of the actions are defined here ([`ProcessAction::min_role`]), and which need a
//! second person ([`ProcessAction::needs_approval`]).

use crate::error::ConsoleError;
use crate::roles::Role;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// Actions on a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProcessAction {
    /// Run an idempotent step again.
    RerunStep,
    /// Ask the remote side for the status of an operation whose outcome is unknown.
    QueryRemoteStatus,
    /// Hand the process to a person (manual review).
    Escalate,
    Pause,
    Resume,
    /// Run the compensation (e.g. refund): needs approval.
    RunCompensation,
    /// Resolve a manual review as succeeded, with evidence: needs approval.
    ResolveSucceeded,
    /// Resolve a manual review as failed.
    ResolveFailed,
}

impl ProcessAction {
    pub const ALL: [ProcessAction; 8] = [
        ProcessAction::RerunStep,
        ProcessAction::QueryRemoteStatus,
        ProcessAction::Escalate,
        ProcessAction::Pause,
        ProcessAction::Resume,
        ProcessAction::RunCompensation,
        ProcessAction::ResolveSucceeded,
        ProcessAction::ResolveFailed,
    ];

    /// The name in URLs (`/api/processes/{id}/actions/{name}`).
    pub fn name(self) -> &'static str {
        match self {
            ProcessAction::RerunStep => "rerun_step",
            ProcessAction::QueryRemoteStatus => "query_remote_status",
            ProcessAction::Escalate => "escalate",
            ProcessAction::Pause => "pause",
            ProcessAction::Resume => "resume",
            ProcessAction::RunCompensation => "run_compensation",
            ProcessAction::ResolveSucceeded => "resolve_succeeded",
            ProcessAction::ResolveFailed => "resolve_failed",
        }
    }

    /// The name in the audit log and metrics.
    pub fn audit_name(self) -> &'static str {
        match self {
            ProcessAction::RerunStep => "process.rerun_step",
            ProcessAction::QueryRemoteStatus => "process.query_remote_status",
            ProcessAction::Escalate => "process.escalate",
            ProcessAction::Pause => "process.pause",
            ProcessAction::Resume => "process.resume",
            ProcessAction::RunCompensation => "process.run_compensation",
            ProcessAction::ResolveSucceeded => "process.resolve_succeeded",
            ProcessAction::ResolveFailed => "process.resolve_failed",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Operator: the reversible ones. Approver: compensations and resolving manual reviews.
    pub fn min_role(self) -> Role {
        match self {
            ProcessAction::RerunStep
            | ProcessAction::QueryRemoteStatus
            | ProcessAction::Escalate
            | ProcessAction::Pause
            | ProcessAction::Resume => Role::Operator,
            ProcessAction::RunCompensation
            | ProcessAction::ResolveSucceeded
            | ProcessAction::ResolveFailed => Role::Approver,
        }
    }

    /// Sensitive: a second approver confirms before it runs.
    pub fn needs_approval(self) -> bool {
        matches!(
            self,
            ProcessAction::RunCompensation | ProcessAction::ResolveSucceeded
        )
    }
}

/// Filters of `GET /api/processes` (manual_review first).
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
pub struct ProcessFilter {
    pub kind: Option<String>,
    pub status: Option<String>,
    /// Only processes older than this many seconds.
    pub older_than_seconds: Option<i64>,
    pub limit: Option<i64>,
}

/// Body of `POST /api/processes/{id}/actions/{action}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ProcessActionRequest {
    pub reason: String,
    /// The process version the operator saw.
    pub version: i64,
    /// Evidence (resolve_succeeded), e.g. the provider's reference.
    pub evidence: Option<String>,
    /// Step for rerun_step.
    pub step: Option<String>,
}

/// What the processes crate provides to the console.
pub trait ProcessBackend: Send + Sync {
    /// Processes matching `filter`, manual_review first (JSON objects; redacted by the console).
    fn list<'a>(
        &'a self,
        pool: &'a PgPool,
        filter: &'a ProcessFilter,
    ) -> BoxFuture<'a, Result<Vec<Value>, ConsoleError>>;

    /// One process: overall and per-step status, last classified error, attempts, operation ids,
    /// external references, timeline, its `version` and `allowed_actions` (the names of the
    /// actions allowed now for its state, error class and remote capability).
    fn get<'a>(
        &'a self,
        pool: &'a PgPool,
        id: Uuid,
    ) -> BoxFuture<'a, Result<Option<Value>, ConsoleError>>;

    /// Performs `action` on `conn` (the console's transaction, which also writes the audit entry).
    /// A version other than the current one is `ConsoleError::Conflict`; an action not allowed
    /// now is `ConsoleError::Conflict` too. Returns (before, after).
    fn perform<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        id: Uuid,
        action: ProcessAction,
        request: &'a ProcessActionRequest,
    ) -> BoxFuture<'a, Result<(Value, Value), ConsoleError>>;
}

/// The answer while no backend is plugged in.
pub fn unavailable() -> ConsoleError {
    ConsoleError::NotImplemented("processes are not available in this build of the console".into())
}
