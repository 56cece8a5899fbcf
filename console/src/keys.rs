//! Idempotency-Keys of console actions, through the workspace's `idempotency` crate.
//!
//! Every action route runs behind [`optional`]: a request with an `Idempotency-Key` goes through
//! the crate's [`idempotency::IdempotencyLayer`], scoped to the console user (the same key of two
//! users never collides), one operation per route (`console POST /api/...`), the fingerprint taken
//! over the path and the body. The layer reserves the key before the handler runs; the handler's
//! effect and audit entries go into the layer's transaction ([`Keyed`], see
//! [`crate::actions::perform`]), in which the layer also stores the response and commits. So a
//! repeated request replays the stored response (`Idempotent-Replayed: true`) and repeats no
//! effect, the same key with another request answers 422, and a request still in flight 409.
//! Responses the layer does not store (401, 403, 409, 5xx) roll the effect back and release the
//! key. Records live in `{{schema}}.idempotency_keys` (the lookup page shows them, scope
//! `console-user:<user id>`) and are purged after their TTL ([`purge`]).
//!
//! A request without a key runs once per request, in the console's own transaction: the web page
//! and the CLI always send one.

use crate::state::AppState;
use crate::users::Authenticated;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, MatchedPath, Request, State};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::Response;
use idempotency::{Idempotency, IdempotencyLayer, KEY_HEADER};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long a key is remembered: a retry within this time replays.
pub const TTL: Duration = Duration::from_secs(7 * 86_400);

/// The console's records in the product schema.
pub fn store(pool: sqlx::PgPool, schema: shared::schema::Schema) -> Idempotency {
    Idempotency::new(pool).schema(schema).ttl(TTL)
}

/// Whose keys: the console user.
pub fn scope_of(principal: &crate::users::Principal) -> String {
    format!("console-user:{}", principal.id)
}

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

/// Purges the console's expired records until `shutdown`.
pub fn purge(store: Idempotency, shutdown: CancellationToken) {
    tokio::spawn(idempotency::purge_loop(
        store,
        idempotency::PurgeSettings::default(),
        async move { shutdown.cancelled().await },
    ));
}
