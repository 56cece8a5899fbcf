//! What can go wrong answering a console request, and the HTTP answer for each: a JSON body with
//! only an `error` field.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// Every error a console route can answer.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("missing or invalid credentials")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unprocessable(String),
    #[error(
        "too many wrong tokens from this address; a wrong one is refused until the minute has passed"
    )]
    TooManyAttempts,
    /// The idempotency layer's transaction could not be had (taken over by a retry, database).
    #[error("idempotency")]
    Idempotency(#[from] idempotency::IdempotencyError),
    #[error("database error")]
    Db(#[from] sqlx::Error),
    #[error("RabbitMQ: {0}")]
    DeadLetters(#[source] Box<consumer::DlqError>),
    /// RabbitMQ did not take an effect (a dead letter not confirmed, no connection).
    #[error("RabbitMQ: {0}")]
    Broker(String),
    #[error("{0}")]
    Internal(String),
}

impl From<consumer::DlqError> for ConsoleError {
    fn from(e: consumer::DlqError) -> Self {
        match e {
            // The request is fine, the consumer's mode refuses it: a 409 that says what to do.
            consumer::DlqError::Ordered { .. } => Self::Conflict(e.to_string()),
            e => Self::DeadLetters(Box::new(e)),
        }
    }
}

/// The body of every error response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: String,
}

impl ConsoleError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::TooManyAttempts => StatusCode::TOO_MANY_REQUESTS,
            Self::Idempotency(e) => e.status(),
            // A listed consumer whose queues do not exist (never ran): there is nothing there.
            Self::DeadLetters(e)
                if matches!(
                    **e,
                    consumer::DlqError::NoDeadLetterQueue { .. }
                        | consumer::DlqError::NoQueue { .. }
                ) =>
            {
                StatusCode::NOT_FOUND
            }
            Self::DeadLetters(_) | Self::Broker(_) => StatusCode::BAD_GATEWAY,
            Self::Db(_) | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The message shown to the client: internal details stay in the log.
    pub fn public_message(&self) -> String {
        match self {
            Self::Db(_) | Self::Internal(_) => "internal error".to_string(),
            Self::Idempotency(e) if e.status().is_server_error() => "internal error".to_string(),
            Self::Idempotency(e) => e.to_string(),
            other => crate::redact::text(&other.to_string()),
        }
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::error!(error = %plumbing::telemetry::ErrorChain(&self), "console request failed");
        }
        let status = self.status();
        (
            status,
            axum::Json(ErrorBody {
                error: self.public_message(),
            }),
        )
            .into_response()
    }
}
