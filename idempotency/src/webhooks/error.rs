//! [`WebhookError`]: every refusal and failure of the receiver, and its answer. A refusal is a
//! 4xx whose body is only `{"error": "<why>"}`; a failure a 5xx with a generic `error` (the cause
//! is logged, never sent), so the provider retries.

use crate::webhooks::event::PayloadError;
use crate::webhooks::handler::HandlerError;
use crate::webhooks::signature::SignatureError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// Why a webhook was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// Over the receiver's body limit: 413.
    #[error("the body is over {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The body could not be read (the connection broke): 400.
    #[error("cannot read the body")]
    BodyUnreadable,
    /// Unsigned, forged, stale (401) or malformed (400).
    #[error(transparent)]
    Signature(#[from] SignatureError),
    /// Signed, but no event the inbox can record: 400.
    #[error("invalid event: {0}")]
    Payload(#[from] PayloadError),
    /// The service's handler failed: 500, rolled back.
    #[error("the webhook handler failed")]
    Handler(#[source] HandlerError),
    /// The service's handler panicked: 500, rolled back.
    #[error("the webhook handler panicked: {0}")]
    Panicked(String),
    /// The pool has no connection for us: 503.
    #[error("database unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// Any other database failure: 500.
    #[error("database error")]
    Database(#[source] sqlx::Error),
}

impl From<sqlx::Error> for WebhookError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => Self::Unavailable(e),
            e => Self::Database(e),
        }
    }
}

impl WebhookError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyUnreadable | Self::Payload(_) => StatusCode::BAD_REQUEST,
            Self::Signature(SignatureError::Malformed { .. }) => StatusCode::BAD_REQUEST,
            Self::Signature(_) => StatusCode::UNAUTHORIZED,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Handler(_) | Self::Panicked(_) | Self::Database(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The `error` sent: the reason for a refusal, a generic word for a failure.
    pub fn message(&self) -> String {
        match self {
            Self::Unavailable(_) => "service temporarily unavailable".to_owned(),
            e if e.status().is_server_error() => "internal server error".to_owned(),
            e => e.to_string(),
        }
    }
}

impl IntoResponse for WebhookError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %crate::error::ErrorChain(&self), status = status.as_u16(), "webhook failed");
        } else {
            tracing::info!(error = %self, status = status.as_u16(), "webhook refused");
        }
        let body = serde_json::json!({ "error": self.message() }).to_string();
        crate::error::json_answer(status, body)
    }
}
