//! [`WebSession`]: the signed-in browser of a page; without a live session cookie the page
//! answers with a redirect to the login page.

use crate::auth::sessions::{self, Session};
use crate::state::AppState;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Redirect, Response};

/// A logged-in browser; without a live session the page answers with the login page.
pub struct WebSession(pub Session);

/// Sends the browser to the login page.
pub struct ToLogin;

impl IntoResponse for ToLogin {
    fn into_response(self) -> Response {
        Redirect::to("/login").into_response()
    }
}

impl FromRequestParts<AppState> for WebSession {
    type Rejection = Response;
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Some(id) = sessions::cookie_value(&parts.headers) else {
            return Err(ToLogin.into_response());
        };
        match sessions::find(&state.pool, &state.schema, &id).await {
            Ok(Some(s)) => Ok(WebSession(s)),
            Ok(None) => Err(ToLogin.into_response()),
            Err(e) => Err(e.into_response()),
        }
    }
}
