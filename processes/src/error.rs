//! How a step's errors classify, and the errors of the library itself.

use std::fmt;
use std::time::Duration;

/// The class of a step error: it decides what happens next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Nothing happened, or it is safe to try again: retry with backoff (within the policy).
    Transient,
    /// Retrying cannot help (validation, authorisation, a definitive refusal): no retry; the
    /// process fails and compensates its earlier effects.
    Permanent,
    /// The remote may have acted (a timeout, a dropped connection, a 5xx after sending): never a
    /// failure; resolved by what the remote supports (same key again, query, or manual review).
    Unknown,
    /// The remote refused before doing anything because it is down or overloaded (503, 429,
    /// connection refused, a timeout before the request was sent): not a failure. The step waits
    /// without spending attempts (through its dependency's circuit, if it names one); only its
    /// policy's deadline, the business deadline, ends the wait.
    Unavailable,
}

impl ErrorClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Permanent => "permanent",
            ErrorClass::Unknown => "unknown",
            ErrorClass::Unavailable => "unavailable",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "transient" => Some(ErrorClass::Transient),
            "permanent" => Some(ErrorClass::Permanent),
            "unknown" => Some(ErrorClass::Unknown),
            "unavailable" => Some(ErrorClass::Unavailable),
            _ => None,
        }
    }

    /// The usual classification of an HTTP status answered by a remote: 429 and 503 are
    /// unavailable (the remote is down or shedding load and did nothing), 408, 425 and 502
    /// transient (the request was not acted on, or may be retried), other 4xx permanent, and
    /// anything else (500, 504, unexpected codes) unknown: the remote may have acted.
    pub fn of_http_status(status: u16) -> Self {
        match status {
            429 | 503 => ErrorClass::Unavailable,
            408 | 425 | 502 => ErrorClass::Transient,
            400..=499 => ErrorClass::Permanent,
            _ => ErrorClass::Unknown,
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a step returns when it did not succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepError {
    pub class: ErrorClass,
    /// Stored redacted (see [`crate::redact::message`]): say what happened, not what was sent.
    pub message: String,
    /// For [`ErrorClass::Unavailable`]: the remote's `Retry-After`, the earliest it wants to be
    /// called again.
    pub retry_after: Option<Duration>,
}

impl StepError {
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
            retry_after: None,
        }
    }
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Transient, message)
    }
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Permanent, message)
    }
    pub fn unknown(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Unknown, message)
    }
    /// The remote is unavailable and did nothing (503, 429, connection refused): the step waits
    /// without spending an attempt.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Unavailable, message)
    }
    /// The remote's `Retry-After`: the step calls again no earlier.
    pub fn retry_after(mut self, d: Option<Duration>) -> Self {
        self.retry_after = d;
        self
    }
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.class, self.message)
    }
}

impl std::error::Error for StepError {}

/// A database error inside a local step is transient: the transaction rolled back, nothing
/// happened, so it can be tried again.
impl From<sqlx::Error> for StepError {
    fn from(e: sqlx::Error) -> Self {
        StepError::transient(format!("database: {e}"))
    }
}

/// Errors of the library's own operations.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database")]
    Database(#[from] sqlx::Error),
    #[error("input is not valid JSON for this definition")]
    Input(#[source] serde_json::Error),
    #[error("process {0} not found")]
    NotFound(uuid::Uuid),
    /// The operator saw an older version of the process than the one stored.
    #[error("process {id} changed since version {seen} (now {current}); reload and decide again")]
    Stale {
        id: uuid::Uuid,
        seen: i64,
        current: i64,
    },
    /// The action is not allowed in the process's current state.
    #[error("{action} is not allowed now: {why}")]
    NotAllowed { action: String, why: String },
    /// The action needs a second person's approval (`approved_by`, not the actor).
    #[error("{action} needs a second person: {why}")]
    NeedsSecondPerson { action: String, why: String },
    /// A reason, actor or evidence was missing or malformed.
    #[error("{0}")]
    Invalid(String),
}
