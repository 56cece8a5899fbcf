//! What `POST /orders` and `POST /payments` share: the route's Idempotency-Key layer over a
//! validated body, and the end of the effect (the event into the outbox, the fault hook before
//! the layer commits). Each handler keeps only what is its own: its checks, rows and event.

use crate::auth::Tenant;
use crate::error::ApiError;
use crate::fault::{Operation, Stage};
use crate::replay_marker::mark_replayed;
use crate::state::AppState;
use crate::validation;
use axum::http::request::Parts;
use idempotency::{EffectTx, IdempotencyLayer};
use serde_json::Value;
use shared::NewMessage;

/// The Idempotency-Key layer of `operation`'s route: scoped by tenant, fingerprinted over the
/// body as `validate` reads it (normalized by `normalize`), which the handler then gets as an
/// extension, so the body is parsed once and a replay with another payload is refused before
/// the handler runs.
pub(crate) fn layer<T: Clone + Send + Sync + 'static>(
    state: &AppState,
    operation: Operation,
    validate: fn(&Value) -> Result<T, ApiError>,
    normalize: fn(&T) -> Value,
) -> IdempotencyLayer {
    state
        .idempotency
        .route(operation.as_str())
        .scope(tenant_scope)
        .fingerprint(move |parts, bytes| {
            let request = validation::json_body(&parts.headers, Ok(bytes.clone()))
                .and_then(|body| validate(&body))?;
            let normalized = normalize(&request);
            parts.extensions.insert(request);
            Ok::<_, ApiError>(normalized)
        })
        .location(move |id| operation.location(id))
        .replay_body(mark_replayed)
}

/// The scope of a key: the tenant the API-key middleware authenticated.
pub(crate) fn tenant_scope(parts: &Parts) -> Option<String> {
    parts.extensions.get::<Tenant>().map(|t| t.0.clone())
}

/// Ends the effect of a request that succeeded: `message` into the configured product schema
/// (like the idempotency record), in the effect's transaction, which the layer then completes
/// and commits.
pub(crate) async fn enqueue_and_finish(
    state: &AppState,
    mut tx: EffectTx<'_>,
    message: &NewMessage,
    operation: Operation,
) -> Result<(), ApiError> {
    shared::outbox::Outbox::new(state.settings.schema.clone())
        .enqueue(&mut *tx, message)
        .await
        .map_err(sqlx::Error::from)?;
    finish(state, tx, operation).await
}

/// Ends the effect: the transaction is handed back to the layer (which completes the record in
/// it and commits), after the fault hook tests use to fail a request just before that commit.
pub(crate) async fn finish(
    state: &AppState,
    tx: EffectTx<'_>,
    operation: Operation,
) -> Result<(), ApiError> {
    drop(tx);
    state.hook(Stage::BeforeCommit, operation).await?;
    Ok(())
}
