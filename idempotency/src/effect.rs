//! What the handler of an idempotent route gets: [`Effect`], an extractor that hands out the
//! effect's own transaction. Its business rows and outbox messages go into that transaction; the
//! layer writes the completed record into it and commits after the handler returned, so all three
//! commit together or not at all. The transaction begins on the first [`Effect::tx`] and starts by
//! locking the record under this request's fencing token: a request whose lease was taken over
//! stops right there. The response parts [`ResourceId`] and [`Pending`] tell the layer what to
//! store.

use crate::error::IdempotencyError;
use crate::persistence::{self, RecordKey};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::response::{IntoResponseParts, ResponseParts};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use std::convert::Infallible;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use uuid::Uuid;

/// The effect of one idempotent request: extract it in the handler (the route must be wrapped in
/// [`crate::IdempotencyLayer`]; elsewhere extraction fails with 500).
#[derive(Clone)]
pub struct Effect {
    pub(crate) shared: Arc<EffectShared>,
}

pub(crate) struct EffectShared {
    pub pool: PgPool,
    pub record: RecordKey,
    pub token: Uuid,
    pub now: DateTime<Utc>,
    pub tx: Mutex<Option<Transaction<'static, Postgres>>>,
    /// Set when the lock found the lease taken over: the layer answers 409 and keeps the record.
    pub superseded: AtomicBool,
}

impl EffectShared {
    /// The transaction, begun and fenced on first use.
    pub(crate) async fn begin<'a>(
        &self,
        slot: &mut MutexGuard<'a, Option<Transaction<'static, Postgres>>>,
    ) -> Result<(), IdempotencyError> {
        if slot.is_some() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        if !persistence::lock(&mut tx, &self.record, self.token).await? {
            self.superseded.store(true, Ordering::SeqCst);
            return Err(IdempotencyError::Superseded);
        }
        **slot = Some(tx);
        Ok(())
    }

    pub(crate) fn is_superseded(&self) -> bool {
        self.superseded.load(Ordering::SeqCst)
    }
}

impl std::fmt::Debug for Effect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Effect")
            .field("scope", &self.shared.record.scope)
            .field("operation", &self.shared.record.operation)
            .field("key", &self.shared.record.key)
            .finish_non_exhaustive()
    }
}

impl Effect {
    /// The effect's transaction: put the business rows and the outbox messages
    /// (`shared::outbox::enqueue(&mut *tx, ..)`) here, and do not commit it: the layer commits it
    /// with the completed record. Fails with [`IdempotencyError::Superseded`] (409) when a retry
    /// took this request's lease over; return that error, the layer rolls back.
    ///
    /// One [`EffectTx`] at a time: asking again while one is alive (e.g. in a helper that got
    /// the `Effect` too) fails with a 500 instead of waiting for itself forever.
    pub async fn tx(&self) -> Result<EffectTx<'_>, IdempotencyError> {
        let mut slot = self.shared.tx.try_lock().map_err(|_| {
            IdempotencyError::Internal(
                "Effect::tx called while an EffectTx of the same request is alive".into(),
            )
        })?;
        self.shared.begin(&mut slot).await?;
        MutexGuard::try_map(slot, Option::as_mut)
            .map(EffectTx)
            .map_err(|_| IdempotencyError::Internal("effect transaction missing".into()))
    }

    /// The time of this request (the store's clock, microseconds): use it for every timestamp the
    /// response shows, so a replay shows the same.
    pub fn now(&self) -> DateTime<Utc> {
        self.shared.now
    }

    /// Whose key it is (what the layer's scope function returned).
    pub fn scope(&self) -> &str {
        &self.shared.record.scope
    }

    /// The operation the layer was made for.
    pub fn operation(&self) -> &str {
        &self.shared.record.operation
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Effect {
    type Rejection = IdempotencyError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Effect>()
            .cloned()
            .ok_or(IdempotencyError::NotBehindLayer)
    }
}

/// The effect's open transaction; derefs to the connection (`&mut *tx` is an executor).
pub struct EffectTx<'a>(MappedMutexGuard<'a, Transaction<'static, Postgres>>);

impl Deref for EffectTx<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for EffectTx<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

/// Response part: the id of the resource the request created. Stored with the record; the layer
/// sets `Location` from it (see [`crate::IdempotencyLayer::location`]) on the response and on
/// every replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceId(pub Uuid);

impl IntoResponseParts for ResourceId {
    type Error = Infallible;
    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Infallible> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// Response part: the request was accepted (2xx) but its outcome is decided downstream; the record
/// is stored as `pending` (replayed, never purged) until the service moves it to `completed`.
/// Needs a [`ResourceId`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending;

impl IntoResponseParts for Pending {
    type Error = Infallible;
    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Infallible> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}
