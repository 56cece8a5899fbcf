//! [`ApiError`]: every error answer of the simulator, as `{"error": "..."}`.

use axum::Json;
use axum::extract::FromRequest;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

/// An error answer. Bad input is a 4xx whose body has only `error`.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("this Idempotency-Key was used with another request body")]
    KeyMismatch,
    #[error("charge declined")]
    Declined { charge_id: Uuid },
    #[error("the provider is temporarily unavailable; nothing was charged")]
    Unavailable,
    #[error("{0}")]
    NotImplemented(String),
    #[error("internal error")]
    Database(#[from] sqlx::Error),
    #[error("internal error: {0}")]
    Corrupt(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::KeyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Declined { .. } => StatusCode::PAYMENT_REQUIRED,
            ApiError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::Database(_) | ApiError::Corrupt(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Database(e) = &self {
            tracing::error!(error = %plumbing::telemetry::ErrorChain(e), "database error");
        }
        let mut response = (
            self.status(),
            Json(serde_json::json!({ "error": self.to_string() })),
        )
            .into_response();
        if let ApiError::Declined { charge_id } = &self
            && let Ok(v) = HeaderValue::from_str(&format!("/charges/{charge_id}"))
        {
            response.headers_mut().insert(header::LOCATION, v);
        }
        if let ApiError::Unavailable = &self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// `Json<T>` whose every rejection (syntax, shape, content type) is a 400 `{"error": ...}`.
#[derive(Debug)]
pub struct Body<T>(pub T);

impl<S, T> FromRequest<S> for Body<T>
where
    Json<T>: FromRequest<S, Rejection = JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        let Json(value) = Json::<T>::from_request(req, state).await?;
        Ok(Body(value))
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        ApiError::BadRequest(r.body_text())
    }
}

/// A query string the handler's `Query<T>` cannot read is a 400 `{"error": ...}`.
impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::BadRequest(r.body_text())
    }
}
