//! Idempotency-Key for any axum route. A service puts [`IdempotencyLayer`] on its own routes;
//! retries with the same key get the first response again instead of a second effect.
//!
//! ```ignore
//! let store = Idempotency::new(pool).schema(schema);
//! let layer = store.route("create_refund")
//!     .scope(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
//!     .location(|id| format!("/refunds/{id}"));
//! Router::new().route("/refunds", post(create_refund).route_layer(layer))
//! // the handler: `effect: Effect`, writes into `effect.tx().await?`, returns `(StatusCode::CREATED, ResourceId(id), body)`
//! ```
//!
//! A short tour:
//! - [`store`]: [`Idempotency`], where records live (pool, product schema) and their TTL, lease
//!   and clock.
//! - [`layer`]: [`IdempotencyLayer`], the request's life: key, scope, fingerprint, reservation,
//!   the handler, then store-and-commit or roll back and release.
//! - [`effect`]: [`Effect`], the extractor that hands the handler its transaction;
//!   [`ResourceId`] and [`Pending`], what the response tells the layer to store.
//! - [`key`]: the `Idempotency-Key` rules and its hash.
//! - [`fingerprint`](mod@fingerprint): canonical JSON and the request fingerprint.
//! - [`persistence`]: the records in `{{schema}}.idempotency_keys` and every statement on them
//!   (reserve, lock, complete, release), fenced by a per-request token.
//! - `release`: giving a key back when its effect did not commit (error, panic, dropped request).
//! - [`replay`]: sending a stored response again with `Idempotent-Replayed: true`.
//! - [`purge`]: expiry, the purge and its loop.
//! - [`error`]: [`IdempotencyError`], what the layer answers itself (`{"error": ...}` only).
//! - [`internal_events`]: every metric in one place.
//!
//! [`webhooks`] is the same once-only idea for the other direction: signed webhooks received
//! into an inbox, deduplicated by event id, their effect committed with the inbox row.
//!
//! **Tables.** `idempotency_keys` (the layer's records; others read them through
//! `Idempotency::lookup`), and for [`webhooks`] `webhook_inbox` and `webhook_objects`.

pub mod effect;
pub mod error;
pub mod fingerprint;
pub mod internal_events;
pub mod key;
pub mod layer;
pub mod lookup;
pub mod persistence;
pub mod purge;
mod release;
pub mod replay;
pub mod store;
pub mod webhooks;

pub use effect::{Effect, EffectTx, Pending, ResourceId};
pub use error::IdempotencyError;
pub use fingerprint::{Fingerprints, Target, canonical_json, fingerprint};
pub use key::{KEY_HEADER, KeyHash, MAX_KEY_LEN, hash_key, validate_key};
pub use layer::{IdempotencyLayer, IdempotencyService, MAX_SCOPE_LEN, stored_by_default};
pub use lookup::RecordSummary;
pub use persistence::{RecordStatus, StoredResponse};
pub use purge::{PurgeSettings, purge_expired, purge_loop};
pub use replay::REPLAYED_HEADER;
pub use store::{Clock, Idempotency};
