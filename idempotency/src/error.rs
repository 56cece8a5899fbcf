//! What the layer answers itself, and its one wire shape: a 4xx body holds only
//! `{"error": "..."}`; a 5xx body only `{"error": "internal server error"}` or
//! `{"error": "service temporarily unavailable"}`. Causes (SQL, panic messages) are logged, never
//! sent.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
pub(crate) use shared::error_chain::ErrorChain;

/// Everything the idempotency layer can fail or refuse with.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    /// Missing, repeated or malformed `Idempotency-Key`: 400, nothing stored.
    #[error("{0}")]
    BadKey(String),
    /// The service's scope function found no principal: 401, nothing stored.
    #[error("authentication required")]
    Unauthenticated,
    /// The body is over the route's `DefaultBodyLimit`: 413.
    #[error("request body too large")]
    PayloadTooLarge,
    /// The body could not be read: 400.
    #[error("cannot read request body")]
    BodyUnreadable,
    /// The default fingerprint needs a JSON body: 400.
    #[error("request body must be valid JSON")]
    InvalidJson,
    /// The body is JSON but not the request the route takes: 422, nothing stored.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Another request holds a live lease on the key: 409 + `Retry-After`.
    #[error("a request with this Idempotency-Key is still being processed; retry later")]
    InFlight,
    /// The key was used with another payload: 422, the original record untouched.
    #[error("this Idempotency-Key was already used with a different request")]
    KeyReused,
    /// A retry took this request's lease over; its effect was rolled back: 409 + `Retry-After`.
    #[error(
        "this request was taken over by a retry with the same Idempotency-Key; retry to get its result"
    )]
    Superseded,
    /// [`crate::Effect`] was extracted on a route without the layer: a programming error, 500.
    #[error("the route has no idempotency layer")]
    NotBehindLayer,
    /// The pool has no connection for us (timed out or closed): 503 + `Retry-After`.
    #[error("database unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// Any other database error: 500.
    #[error("database error")]
    Database(#[source] sqlx::Error),
    /// The handler's outbox message was refused or could not be written: 500.
    #[error("cannot add the message to the outbox")]
    Enqueue(#[from] shared::outbox::EnqueueError),
    /// The handler panicked: 500 (the key was released first).
    #[error("request handler panicked: {0}")]
    Panicked(String),
    /// Anything else that is our fault: 500.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<sqlx::Error> for IdempotencyError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => Self::Unavailable(e),
            e => Self::Database(e),
        }
    }
}

impl IdempotencyError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadKey(_) | Self::BodyUnreadable | Self::InvalidJson => StatusCode::BAD_REQUEST,
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::InFlight | Self::Superseded => StatusCode::CONFLICT,
            Self::KeyReused | Self::InvalidRequest(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::NotBehindLayer
            | Self::Database(_)
            | Self::Enqueue(_)
            | Self::Panicked(_)
            | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Whether the response carries `Retry-After: 1`.
    pub fn retry_after(&self) -> bool {
        matches!(
            self,
            Self::InFlight | Self::Superseded | Self::Unavailable(_)
        )
    }

    /// The JSON body sent for this error.
    pub fn body(&self) -> String {
        let message = match self {
            Self::Unavailable(_) => "service temporarily unavailable".to_owned(),
            e if e.status().is_server_error() => "internal server error".to_owned(),
            e => e.to_string(),
        };
        serde_json::json!({ "error": message }).to_string()
    }
}

impl IntoResponse for IdempotencyError {
    fn into_response(self) -> Response {
        answer(&self, self.status(), self.body(), self.retry_after())
    }
}

/// An error answer of a service behind the layer in the one wire shape: `status`, the JSON
/// `body`, and `Retry-After: 1` if `retry_after`. A 5xx is logged with its whole cause chain, a
/// 4xx at debug level.
pub fn answer(
    error: &(dyn std::error::Error + 'static),
    status: StatusCode,
    body: String,
    retry_after: bool,
) -> Response {
    if status.is_server_error() {
        tracing::error!(error = %ErrorChain(error), status = status.as_u16(), "request failed");
    } else {
        tracing::debug!(error = %error, status = status.as_u16(), "request rejected");
    }
    let mut response = json_answer(status, body);
    if retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// `status` with a JSON `body`.
pub fn json_answer(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
