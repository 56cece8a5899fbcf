//! Expiry: completed and failed records past `expires_at`, and reservations abandoned for longer
//! than the TTL (their holder died and nobody retried), are deleted in bounded batches. Pending
//! records and live reservations stay. [`purge_expired`] runs once; [`purge_loop`] runs it on an
//! interval until shutdown.

use crate::error::ErrorChain;
use crate::internal_events;
use crate::store::{Idempotency, sub};
use chrono::{DateTime, Utc};
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::Duration;

/// Deletes expired records in batches of `batch_size`, at most `max_batches` statements: completed
/// and failed records whose `expires_at` passed, and processing records whose lease ended more than
/// `ttl` ago. Returns how many were deleted.
///
/// Each kind is taken oldest first through its own partial index, and each statement goes on from
/// where the last one ended instead of from the start of the index. While an old snapshot holds
/// back vacuum, the entries of every record deleted (or completed) since stay in those indexes;
/// starting each statement at the start would walk them all again, so a run's cost would grow
/// with the square of what it deletes. A record that expires behind the cursor during a run is
/// deleted by the next run. Records go by the `ctid` of the version the batch locked (an array, so
/// no plan joins the batch to the whole table), and only if still expired: a record a request
/// completed meanwhile has another version and stays.
pub async fn purge_expired(
    pool: &PgPool,
    schema: &Schema,
    now: DateTime<Utc>,
    ttl: Duration,
    batch_size: u32,
    max_batches: u32,
) -> Result<u64, sqlx::Error> {
    let abandoned_before = sub(now, ttl);
    let batch_size = i64::from(batch_size.max(1));
    let mut total = 0u64;
    let mut statements = 0;
    for (column, status, before) in [
        ("expires_at", "status IN ('completed', 'failed')", now),
        (
            "lease_expires_at",
            "status = 'processing'",
            abandoned_before,
        ),
    ] {
        let template = format!(
            "WITH gone AS ( \
                 DELETE FROM {{{{schema}}}}.idempotency_keys WHERE ctid = ANY(ARRAY( \
                     SELECT ctid FROM {{{{schema}}}}.idempotency_keys \
                     WHERE {status} AND {column} <= $1 AND {column} >= coalesce($3, '-infinity') \
                     ORDER BY {column} LIMIT $2 FOR UPDATE SKIP LOCKED)) \
                   AND {status} AND {column} <= $1 \
                 RETURNING {column}) \
             SELECT count(*), max({column}) FROM gone"
        );
        let mut cursor: Option<DateTime<Utc>> = None;
        while statements < max_batches {
            statements += 1;
            let (n, last): (i64, Option<DateTime<Utc>>) = sqlx::query_as(schema.sql(&template))
                .bind(before)
                .bind(batch_size)
                .bind(cursor)
                .fetch_one(pool)
                .await?;
            total += n as u64;
            cursor = last.or(cursor);
            if n < batch_size {
                break;
            }
        }
    }
    if total > 0 {
        internal_events::purged(total);
    }
    Ok(total)
}

/// How the background purge runs.
#[derive(Debug, Clone, Copy)]
pub struct PurgeSettings {
    /// Time between two runs.
    pub interval: Duration,
    /// Rows per statement (bounded batches keep locks and WAL bursts small).
    pub batch_size: u32,
    /// Statements per run (the next run continues).
    pub max_batches: u32,
}

impl Default for PurgeSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            batch_size: 1000,
            max_batches: 100,
        }
    }
}

/// Purges `store`'s expired records every `settings.interval` until `shutdown` resolves. A failed
/// run is logged and retried at the next interval.
pub async fn purge_loop(
    store: Idempotency,
    settings: PurgeSettings,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(settings.interval) => {}
        }
        match purge_expired(
            &store.pool,
            &store.schema,
            store.now(),
            store.ttl,
            settings.batch_size,
            settings.max_batches,
        )
        .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(purged = n, "purged expired idempotency records"),
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "purging idempotency records failed")
            }
        }
    }
}

impl Idempotency {
    /// [`purge_expired`] on this store's records with its clock and TTL.
    pub async fn purge(&self, batch_size: u32, max_batches: u32) -> Result<u64, sqlx::Error> {
        purge_expired(
            &self.pool,
            &self.schema,
            self.now(),
            self.ttl,
            batch_size,
            max_batches,
        )
        .await
    }
}
