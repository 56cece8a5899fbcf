//! The idempotency layer on the action routes ([`optional`]) and the handlers' view of it
//! ([`Keyed`]); where the records live and whose they are is [`crate::auth::keys`].

use crate::auth::keys::scope_of;
use crate::auth::users::Authenticated;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, MatchedPath, Request, State};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::Response;
use idempotency::{Idempotency, IdempotencyLayer, KEY_HEADER};
use serde_json::{Value, json};
use std::convert::Infallible;

/// What the fingerprint is taken over: the path (ids, action) and the body as sent (JSON when it
/// is JSON, so key order and whitespace do not matter; its text otherwise, so the handler still
/// answers a malformed body itself, after the role check).
fn normalized(parts: &Parts, body: &Bytes) -> Value {
    let body = serde_json::from_slice::<Value>(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()));
    json!({"path": parts.uri.path(), "body": body})
}

/// The layer for one action route.
fn layer(store: &Idempotency, route: &str) -> IdempotencyLayer {
    store
        .route(&format!("console POST {route}"))
        .scope(|parts| {
            parts
                .extensions
                .get::<Authenticated>()
                .map(|a| scope_of(&a.0))
        })
        .fingerprint(|parts, body| Ok::<_, Infallible>(normalized(parts, body)))
}

/// Middleware of every action route (behind authentication): through the idempotency layer when
/// the request has a key, straight to the handler otherwise.
pub async fn optional(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if !request.headers().contains_key(KEY_HEADER) {
        return next.run(request).await;
    }
    // The route's template (`/api/processes/{id}/actions/{action}`), never the request's own
    // path: the operation name is bounded and the same for every request of one route.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("(unmatched)", |m| m.as_str())
        .to_string();
    let mut service = tower_layer::Layer::layer(&layer(&state.idempotency, &route), next);
    match tower_service::Service::call(&mut service, request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The idempotency layer's effect, when the request came with a key: its transaction is the one
/// the action writes into.
pub struct Keyed(pub Option<idempotency::Effect>);

impl<S: Send + Sync> FromRequestParts<S> for Keyed {
    type Rejection = Infallible;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        Ok(Keyed(
            parts.extensions.get::<idempotency::Effect>().cloned(),
        ))
    }
}
