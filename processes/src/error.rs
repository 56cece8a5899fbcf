//! How a step's errors classify, and the errors of the library itself.

use std::fmt;

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
}

impl ErrorClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Permanent => "permanent",
            ErrorClass::Unknown => "unknown",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "transient" => Some(ErrorClass::Transient),
            "permanent" => Some(ErrorClass::Permanent),
            "unknown" => Some(ErrorClass::Unknown),
            _ => None,
        }
    }

    /// The usual classification of an HTTP status answered by a remote: 408, 425, 429, 502 and
    /// 503 are transient (the request was not acted on, or may be retried), other 4xx permanent,
    /// and anything else (500, 504, unexpected codes) unknown: the remote may have acted.
    pub fn of_http_status(status: u16) -> Self {
        match status {
            408 | 425 | 429 | 502 | 503 => ErrorClass::Transient,
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
}

impl StepError {
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
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
