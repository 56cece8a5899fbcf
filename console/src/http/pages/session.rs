//! [`WebSession`]: the signed-in browser of a page; without a live session cookie the page
//! answers with a redirect to the login page.

use crate::auth::sessions::{self, Session};
use crate::state::AppState;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Redirect, Response};

/// A logged-in browser; without a live session the page answers with the login page.
pub struct WebSession(pub Session);

/// Sends the browser to the login page; for a page it asked for (a GET), with that page as `next`
/// so that a deep link survives the login.
pub struct ToLogin(pub Option<String>);

impl IntoResponse for ToLogin {
    fn into_response(self) -> Response {
        match self.0.as_deref().filter(|n| safe_next(n) && *n != "/") {
            Some(next) => Redirect::to(&format!("/login?next={}", crate::text::url_encode(next)))
                .into_response(),
            None => Redirect::to("/login").into_response(),
        }
    }
}

/// Whether `next` is a page of this console to go to after the login: a path of its own (one
/// `/`, not `//` or `/\`, which browsers read as another host), printable, not too long. Anything
/// else goes to the overview, so the login is no open redirect.
pub fn safe_next(next: &str) -> bool {
    next.starts_with('/')
        && !next.starts_with("//")
        && !next.starts_with("/\\")
        && next.len() <= 2000
        && !next.chars().any(|c| c.is_control() || c == '\\')
}

impl FromRequestParts<AppState> for WebSession {
    type Rejection = Response;
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let next = (parts.method == axum::http::Method::GET)
            .then(|| parts.uri.path_and_query().map(|p| p.as_str().to_string()))
            .flatten();
        let Some(id) = sessions::cookie_value(&parts.headers, state.settings.cookie_secure) else {
            return Err(ToLogin(next).into_response());
        };
        match sessions::find(&state.pool, &state.schema, &id, state.settings.session_idle).await {
            Ok(Some(s)) => Ok(WebSession(s)),
            Ok(None) => Err(ToLogin(next).into_response()),
            Err(e) => Err(e.into_response()),
        }
    }
}
