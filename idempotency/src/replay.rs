//! Sending a stored response again: the stored status and body bytes, `Content-Type:
//! application/json`, `Idempotent-Replayed: true`, and `Location` for a 2xx with a resource.
//! A service may transform the replayed body (e.g. flip a `"replayed":false` marker), see
//! [`crate::IdempotencyLayer::replay_body`]; by default the body is byte-identical.

use crate::persistence::StoredResponse;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// Response header set on replays.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The HTTP response replaying `stored`: its body through `transform` when the route has one,
/// `location` (the route's URL of the stored resource) on a 2xx.
pub(crate) fn replay(
    stored: &StoredResponse,
    transform: Option<&(dyn Fn(&str) -> String + Send + Sync)>,
    location: Option<HeaderValue>,
) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match transform {
        Some(transform) => transform(&stored.body),
        None => stored.body.clone(),
    };
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    if status.is_success()
        && let Some(location) = location
    {
        headers.insert(header::LOCATION, location);
    }
    response
}
