//! The API's errors and their one wire shape: a 4xx body holds only `{"error": "..."}` or
//! `{"errors": [{"field", "message", "code"}]}`; a 5xx body only `{"error": "..."}`. Causes
//! (SQL, driver, panic messages) are logged, never sent.

use crate::fault::InjectedFault;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idempotency::IdempotencyError;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One problem with one field of the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FieldError {
    /// Path of the field, e.g. `amount` or `items[0].quantity`.
    pub field: String,
    /// Human-readable explanation.
    pub message: String,
    /// Stable machine-readable code: `required`, `invalid_type`, `invalid_value`, `unknown_field`,
    /// `duplicate_field`, `out_of_range`, `too_long`, `overflow`, `currency_mismatch`.
    pub code: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, code: &str, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
            code: code.to_owned(),
        }
    }
}

/// Body of every error that is not about individual fields.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    pub error: String,
}

/// Body of a validation error: one entry per problem.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ValidationErrorBody {
    pub errors: Vec<FieldError>,
}

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("missing or invalid API key")]
    Unauthorized,
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("method not allowed")]
    MethodNotAllowed,
    /// What the idempotency layer answers (bad key, 409 in flight or superseded, 422 reuse...).
    #[error(transparent)]
    Idempotency(#[from] IdempotencyError),
    #[error("request body too large")]
    PayloadTooLarge,
    #[error("Content-Type must be application/json")]
    UnsupportedMediaType,
    #[error("request validation failed")]
    Validation(Vec<FieldError>),
    #[error("database unavailable")]
    Unavailable(#[source] sqlx::Error),
    #[error("database error")]
    Database(#[source] sqlx::Error),
    #[error("fault injected")]
    Injected(#[from] InjectedFault),
    #[error("request handler panicked: {0}")]
    Panicked(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => ApiError::Unavailable(e),
            e => ApiError::Database(e),
        }
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Idempotency(e) => e.status(),
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Validation(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Database(_)
            | ApiError::Injected(_)
            | ApiError::Panicked(_)
            | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The JSON body sent for this error (the same bytes are stored for definitive errors).
    pub fn body(&self) -> String {
        let json = match self {
            ApiError::Validation(errors) => serde_json::to_string(&ValidationErrorBody {
                errors: errors.clone(),
            }),
            ApiError::Idempotency(e) => return e.body(),
            ApiError::Unavailable(_) => serde_json::to_string(&ErrorBody {
                error: "service temporarily unavailable".into(),
            }),
            ApiError::Database(_)
            | ApiError::Injected(_)
            | ApiError::Panicked(_)
            | ApiError::Internal(_) => serde_json::to_string(&ErrorBody {
                error: "internal server error".into(),
            }),
            other => serde_json::to_string(&ErrorBody {
                error: other.to_string(),
            }),
        };
        json.unwrap_or_else(|_| r#"{"error":"internal server error"}"#.to_owned())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = match &self {
            ApiError::Unavailable(_) => true,
            ApiError::Idempotency(e) => e.retry_after(),
            _ => false,
        };
        let mut response =
            idempotency::error::answer(&self, self.status(), self.body(), retry_after);
        if let ApiError::Unauthorized = self {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
