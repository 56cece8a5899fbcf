//! The errors of the breaker crate.

/// A policy that cannot work, with the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dependency policy refused: {0}")]
pub struct PolicyError(pub String);

/// Why a dependency could not be declared.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeclareError {
    #[error("invalid dependency name {0:?}: use 1-100 characters of A-Z a-z 0-9 . _ -")]
    Name(String),
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// Why an operator's action on a dependency was refused.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("no dependency named {0:?}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("database")]
    Database(#[from] sqlx::Error),
}
