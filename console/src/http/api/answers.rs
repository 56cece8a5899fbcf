//! The shape of every API answer: `{"error": "..."}` for every error, JSON for an action's
//! outcome, a 400 for a malformed body only after the role check.

use crate::actions::{Action, Caller, Outcome};
use crate::error::ConsoleError;
use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

/// Every error the API answers has the one shape `{"error": "..."}`. The console's own errors
/// have it already; axum's rejections do not (a path id that is no UUID, a query that does not
/// parse: plain text; a method the route does not take: an empty 405). This gives them that shape,
/// with their text as the message (for a 5xx, only "internal server error"), keeping their status
/// and headers (`Allow`, `Retry-After`).
pub(super) async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let error = if status.is_server_error() {
        "internal server error".to_string()
    } else if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("bad request")
            .to_lowercase()
    } else {
        text
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::json!({ "error": error }).to_string();
    Response::from_parts(parts, Body::from(body))
}

/// An action's answer (replays are answered by the idempotency layer, byte for byte).
pub fn outcome_response(o: Outcome) -> Response {
    let mut r = (o.status, o.body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The body of an action request as `T`. A body that is not one is a 400, but only for a caller
/// who may do `action` on `target`: anyone else gets (and the audit log records) the 403 first.
pub(super) async fn parse_for<T: DeserializeOwned>(
    call: &Caller,
    action: Action,
    target: &str,
    body: &Bytes,
) -> Result<T, ConsoleError> {
    match serde_json::from_slice(body) {
        Ok(t) => Ok(t),
        Err(e) => {
            call.authorize(action, target, "").await?;
            Err(ConsoleError::BadRequest(format!("invalid JSON body: {e}")))
        }
    }
}

/// 404 for unknown API paths, as JSON.
pub async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(crate::error::ErrorBody {
            error: "no such route".into(),
        }),
    )
        .into_response()
}
