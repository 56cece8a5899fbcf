//! What every form shares: the hidden CSRF token and fresh Idempotency-Key, the CSRF check of a
//! POST, and sending the form's action to the API route as the session's user
//! ([`crate::http::api::forward`]), so a form takes the same path as an API request.

use super::errors::{answer_page, error_page};
use super::notice::Notice;
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::state::AppState;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde_json::Value;
use std::str::FromStr;
use uuid::Uuid;

/// A form's fields as posted (a name may repeat: `item`).
pub type Fields = Vec<(String, String)>;

/// The first value of field `name`.
pub fn field<'a>(f: &'a Fields, name: &str) -> Option<&'a str> {
    f.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The hidden fields of every action form: the session's CSRF token and a fresh Idempotency-Key
/// (a form sent twice runs once).
pub fn hidden(session: &Session) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(session.csrf);
        input type="hidden" name="idempotency_key" value=(Uuid::new_v4());
    }
}

/// The CSRF check of every form POST: a missing or wrong token is a denied attempt (403).
pub async fn csrf(state: &AppState, s: &Session, f: &Fields, action: &str) -> Result<(), Response> {
    if field(f, "csrf") == Some(s.csrf.as_str()) {
        return Ok(());
    }
    let e = crate::actions::deny(
        state,
        &s.principal,
        action,
        "web form",
        "",
        "missing or wrong CSRF token".into(),
    )
    .await;
    Err(error_page(Some(s), &e))
}

/// The checks of a form acting on one target at the version the page showed: CSRF ([`csrf`]),
/// then the field `version` (a form without one is a 400 page).
pub async fn csrf_and_version<T: FromStr>(
    state: &AppState,
    s: &Session,
    f: &Fields,
    action: &str,
) -> Result<T, Response> {
    csrf(state, s, f, action).await?;
    field(f, "version")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| error_page(Some(s), &ConsoleError::BadRequest("version missing".into())))
}

/// Sends a form's action to the API route `path` with `body`, as the session's user and with the
/// form's Idempotency-Key; returns the status and the JSON answer.
///
/// A dry run (`"dry_run": true` in `body`) is sent without the key: it changes nothing, and
/// spending the form's key on it made the real action from the same form (after the browser's
/// Back) a 422, "this Idempotency-Key was already used with a different request".
pub async fn submit(
    state: &AppState,
    session: &Session,
    f: &Fields,
    path: &str,
    body: Value,
) -> (StatusCode, Value) {
    let dry_run = body.get("dry_run") == Some(&Value::Bool(true));
    let key = field(f, "idempotency_key").filter(|k| !k.is_empty() && !dry_run);
    let response = crate::http::api::forward(state, &session.principal, path, key, &body).await;
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20)
        .await
        .unwrap_or_default();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Back to `path` (a page of the console) with the notice for the action's answer `v`.
pub fn notice_redirect_to(path: &str, v: &Value) -> Response {
    Redirect::to(&Notice::of_answer(v).url(path, v)).into_response()
}

/// The page of an action's answer ([`submit`]): a success returns to `back` with its notice
/// ([`notice_redirect_to`]), anything else is the error page ([`answer_page`]).
pub fn answered(session: &Session, back: &str, (status, v): (StatusCode, Value)) -> Response {
    if status.is_success() {
        notice_redirect_to(back, &v)
    } else {
        answer_page(session, status, &v, back)
    }
}
