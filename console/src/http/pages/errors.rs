//! The console's error page: every error a web route answers, whoever made it (the console, the
//! API behind a form, axum's own rejections), is one page with its status and public message.

use super::layout::{page, shown};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde_json::Value;

/// The body of the error page: status, message (redacted), a way back.
fn error_body(status: StatusCode, message: &str) -> Markup {
    html! {
        p.error #error { (status.as_u16()) " " (shown(message)) }
        p { a href="/" { "Back" } }
    }
}

/// The console's error page for `e` (its status, its public message).
pub fn error_page(session: Option<&Session>, e: &ConsoleError) -> Response {
    let body = error_body(e.status(), &e.public_message());
    (e.status(), page(session, "Error", body)).into_response()
}

/// The error page for an API answer that is not a success, with a link back to `back` (the page
/// the form was on). A conflict is explained in words before the API's message: nothing was
/// done, someone acted on the item since the page was opened, and how to go on.
pub fn answer_page(session: &Session, status: StatusCode, body: &Value, back: &str) -> Response {
    let message = body
        .get("error")
        .and_then(|e| e.as_str())
        .unwrap_or("the action failed");
    let back = if super::session::safe_next(back) {
        back
    } else {
        "/"
    };
    let page_body = html! {
        @if status == StatusCode::CONFLICT {
            p.error #conflict {
                "Nothing was done: this changed since you opened the page (someone acted on it, or a \
                 worker moved it on). Open it again to see what it is now, then decide again."
            }
            p { small { "The console said: " (shown(message)) } }
        } @else {
            p.error #error { (status.as_u16()) " " (shown(message)) }
        }
        p { a #back href=(back) { @if back == "/" { "Back to the overview" } @else { "Back to where you were" } } }
    };
    (status, page(Some(session), "Error", page_body)).into_response()
}

/// Every error a web route answers is the console's error page: axum's own rejections (a form
/// that does not parse, a path id that is no UUID, a method the route does not take) are plain
/// text or empty, and the console's errors JSON. This gives them the page, keeping their status
/// and headers (`Allow`, `Retry-After`); for a 5xx only "internal error".
pub async fn html_errors(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_html = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html"));
    if is_html || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let message = if status.is_server_error() {
        "internal error".to_string()
    } else {
        serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string())
    };
    let message = if message.is_empty() {
        status.canonical_reason().unwrap_or("error").to_lowercase()
    } else {
        message
    };
    let body = error_body(status, &crate::text::printable(&message));
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    Response::from_parts(parts, axum::body::Body::from(page(None, "Error", body).0))
}
