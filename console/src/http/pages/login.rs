//! Logging in with a token (rate-limited per address) and out: the session cookie.

use super::errors::error_page;
use super::forms::{Fields, csrf};
use super::layout::{page, shown};
use super::session::{WebSession, safe_next};
use crate::auth::{sessions, users};
use crate::error::ConsoleError;
use crate::internal_events;
use crate::state::AppState;
use axum::Form;
use axum::extract::{ConnectInfo, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::html;
use std::collections::HashMap;
use std::net::SocketAddr;

/// Where to go after the login (`?next=`: the page asked for before it).
#[derive(Debug, Default, serde::Deserialize)]
pub struct Next {
    next: Option<String>,
}

/// `GET /login`.
pub async fn login_page(Query(n): Query<Next>) -> Html<String> {
    login_form(None, n.next.as_deref())
}

/// The login form, with the reason the last attempt failed and the page to go to after it.
fn login_form(message: Option<&str>, next: Option<&str>) -> Html<String> {
    let next = next.filter(|n| safe_next(n));
    page(
        None,
        "Log in",
        html! {
            @if let Some(m) = message { p.error #error { (shown(m)) } }
            form method="post" action="/login" {
                @if let Some(n) = next { input type="hidden" name="next" value=(n); }
                label { "Token " input type="password" #token name="token" autocomplete="off" autofocus required; }
                " "
                button #login { "Log in" }
            }
            p { "Tokens come from " code { "console user create" } "." }
        },
    )
}

/// `POST /login`: a valid token starts a session (cookie) and goes to the page asked for before
/// it (`next`, a path of the console's own), else to the overview.
pub async fn login(
    State(s): State<AppState>,
    ConnectInfo(addr): ConnectInfo<SocketAddr>,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    let ip = addr.ip();
    // A throttled address is refused every wrong token, but not a right one: everyone behind one
    // proxy or office address shares it, and five wrong tries by one person must not lock out
    // the others. That costs the throttle nothing: a token is 256 random bits, which no rate of
    // guessing finds; the throttle keeps the noise of wrong tries down and counts it.
    let throttled = !s.limiter.may_try(ip);
    let token = f.get("token").map(|t| t.trim()).unwrap_or("");
    let principal = match users::by_token(&s.pool, &s.schema, token).await {
        Ok(Some(p)) => p,
        Ok(None) if throttled => {
            internal_events::login_failed("rate_limited", ip);
            return (
                StatusCode::TOO_MANY_REQUESTS,
                login_form(
                    Some(&ConsoleError::TooManyAttempts.to_string()),
                    f.get("next").map(String::as_str),
                ),
            )
                .into_response();
        }
        Ok(None) => {
            s.limiter.failed(ip);
            internal_events::login_failed("invalid_token", ip);
            return (
                StatusCode::UNAUTHORIZED,
                login_form(
                    Some("unknown or revoked token"),
                    f.get("next").map(String::as_str),
                ),
            )
                .into_response();
        }
        Err(e) => return error_page(None, &e),
    };
    match sessions::create(&s.pool, &s.schema, &principal, s.settings.session_ttl).await {
        Ok((id, _csrf)) => {
            internal_events::login(&principal);
            let next = f
                .get("next")
                .map(String::as_str)
                .filter(|n| safe_next(n))
                .unwrap_or("/");
            let mut r = Redirect::to(next).into_response();
            if let Ok(v) = HeaderValue::from_str(&sessions::set_cookie(
                &id,
                s.settings.session_ttl,
                s.settings.cookie_secure,
            )) {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            r
        }
        Err(e) => error_page(None, &e),
    }
}

/// `POST /logout`: the session ends, the cookie is cleared.
pub async fn logout(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    headers: axum::http::HeaderMap,
    Form(f): Form<Fields>,
) -> Response {
    if let Err(r) = csrf(&s, &session, &f, "logout").await {
        return r;
    }
    if let Some(id) = sessions::cookie_value(&headers, s.settings.cookie_secure) {
        let _ = sessions::delete(&s.pool, &s.schema, &id).await;
    }
    let mut r = Redirect::to("/login").into_response();
    if let Ok(v) = HeaderValue::from_str(&sessions::clear_cookie(s.settings.cookie_secure)) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}
