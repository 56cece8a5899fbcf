//! Releasing a reservation whose effect did not commit, so a retry runs anew: awaited on errors
//! and panics (before the response leaves, so the client's retry finds the key free), spawned from
//! `Drop` when the request itself is dropped mid-flight (client gone). The delete is fenced by the
//! token and by `status = 'processing'`, so it is harmless after a commit whose acknowledgement
//! was lost.
//!
//! The reservation itself runs as a task of its own ([`ReleaseGuard::reserve`]): a request dropped
//! while its reserving statement is on the wire would otherwise race its own release (the delete
//! finding nothing, the insert landing after it, the key answering 409 until its lease expired).
//! The release of a dropped request waits for that task first.

use crate::error::ErrorChain;
use crate::internal_events::{self, ReleaseReason};
use crate::persistence::{self, RecordKey, Reservation};
use sqlx::PgPool;
use tokio::task::{JoinError, JoinHandle};
use uuid::Uuid;

/// What the reserving statement answered.
pub(crate) type Reserved = Result<Reservation, sqlx::Error>;

pub(crate) struct ReleaseGuard {
    pool: PgPool,
    record: RecordKey,
    token: Uuid,
    armed: bool,
    /// The reservation task while it has not settled.
    reserving: Option<JoinHandle<Reserved>>,
}

impl ReleaseGuard {
    pub(crate) fn new(pool: PgPool, record: RecordKey, token: Uuid) -> Self {
        Self {
            pool,
            record,
            token,
            armed: true,
            reserving: None,
        }
    }

    /// Runs `reservation` as its own task and waits for it: if this request is dropped meanwhile,
    /// the task still settles, and the release waits for it.
    pub(crate) async fn reserve(
        &mut self,
        reservation: impl Future<Output = Reserved> + Send + 'static,
    ) -> Result<Reserved, JoinError> {
        let task = self.reserving.insert(tokio::spawn(reservation));
        let settled = task.await;
        self.reserving = None;
        settled
    }

    /// The effect committed, or the key is someone else's now: nothing to release.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Releases now and waits for it.
    pub(crate) async fn release(mut self, reason: ReleaseReason) {
        self.armed = false;
        release_logged(&self.pool, &self.record, self.token, reason).await;
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (pool, record, token) = (self.pool.clone(), self.record.clone(), self.token);
        let reserving = self.reserving.take();
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if let Some(task) = reserving {
                        let _ = task.await;
                    }
                    release_logged(&pool, &record, token, ReleaseReason::Cancelled).await
                });
            }
            Err(_) => tracing::warn!(
                key = %record.key.log_id(),
                "no runtime to release the reservation; its lease will expire"
            ),
        }
    }
}

async fn release_logged(pool: &PgPool, record: &RecordKey, token: Uuid, reason: ReleaseReason) {
    match persistence::release(pool, record, token).await {
        Ok(true) => {
            internal_events::reservation_released(&record.operation, reason);
            tracing::info!(
                key = %record.key.log_id(),
                operation = %record.operation,
                reason = reason.as_str(),
                "released idempotency reservation without effect"
            );
        }
        Ok(false) => {}
        Err(e) => tracing::warn!(
            key = %record.key.log_id(),
            error = %ErrorChain(&e),
            "cannot release idempotency reservation; a retry takes it over once its lease expires"
        ),
    }
}
