//! The caller of an API route: a bearer token (`Authorization: Bearer ct_...`), or the session's
//! user of a forwarded web form ([`Authenticated`]); on an action route, with the
//! Idempotency-Key's effect ([`Caller`]).

use crate::actions::{self, Action, Caller};
use crate::auth::users::{self, Authenticated, Principal};
use crate::error::ConsoleError;
use crate::http::keys::Keyed;
use crate::state::AppState;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::header;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The authenticated caller of an API route.
pub struct Bearer(pub Principal);

async fn principal_of(parts: &Parts, state: &AppState) -> Result<Principal, ConsoleError> {
    if let Some(a) = parts.extensions.get::<Authenticated>() {
        return Ok(a.0.clone());
    }
    let token = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or(ConsoleError::Unauthorized)?;
    users::by_token(&state.pool, &state.schema, token)
        .await?
        .ok_or(ConsoleError::Unauthorized)
}

impl FromRequestParts<AppState> for Bearer {
    type Rejection = ConsoleError;
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        principal_of(parts, state).await.map(Bearer)
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ConsoleError;
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let principal = principal_of(parts, state).await?;
        let Ok(Keyed(keyed)) = Keyed::from_request_parts(parts, state).await;
        Ok(Caller {
            state: state.clone(),
            principal,
            keyed,
        })
    }
}

/// Middleware of the action routes: the caller, before the idempotency layer needs its scope
/// (401 here, nothing reserved).
pub(super) async fn authenticate(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    match principal_of(&parts, &state).await {
        Ok(p) => {
            parts.extensions.insert(Authenticated(p));
            next.run(Request::from_parts(parts, body)).await
        }
        Err(e) => e.into_response(),
    }
}

pub(super) async fn read(state: &AppState, p: &Principal, what: &str) -> Result<(), ConsoleError> {
    actions::authorize(state, p, Action::Read, what, "").await
}
