//! Idempotency-Keys of console actions, through the workspace's `idempotency` crate.
//!
//! Every action route runs behind `crate::http::keys::optional`: a request with an `Idempotency-Key` goes through
//! the crate's [`idempotency::IdempotencyLayer`], scoped to the console user (the same key of two
//! users never collides), one operation per route (`console POST /api/...`), the fingerprint taken
//! over the path and the body. The layer reserves the key before the handler runs; the handler's
//! effect and audit entries go into the layer's transaction (`Keyed`, see
//! [`crate::actions::perform`]), in which the layer also stores the response and commits. So a
//! repeated request replays the stored response (`Idempotent-Replayed: true`) and repeats no
//! effect, the same key with another request answers 422, and a request still in flight 409.
//! Responses the layer does not store (401, 403, 409, 5xx) roll the effect back and release the
//! key. Records live in `{{schema}}.idempotency_keys` (the lookup page shows them, scope
//! `console-user:<user id>`) and are purged after their TTL ([`purge`]).
//!
//! A request without a key runs once per request, in the console's own transaction: the web page
//! and the CLI always send one.

use idempotency::Idempotency;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long a key is remembered: a retry within this time replays.
pub const TTL: Duration = Duration::from_secs(7 * 86_400);

/// The console's records in the product schema.
pub fn store(pool: sqlx::PgPool, schema: shared::schema::Schema) -> Idempotency {
    Idempotency::new(pool).schema(schema).ttl(TTL)
}

/// Whose keys: the console user.
pub fn scope_of(principal: &super::users::Principal) -> String {
    format!("console-user:{}", principal.id)
}

/// Purges the console's expired records until `shutdown`.
pub fn purge(store: Idempotency, shutdown: CancellationToken) {
    tokio::spawn(idempotency::purge_loop(
        store,
        idempotency::PurgeSettings::default(),
        async move { shutdown.cancelled().await },
    ));
}
