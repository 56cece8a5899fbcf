//! Deletes old deduplication rows in bounded batches, one instance at a time.

use crate::internal_events::Events;
use chrono::{DateTime, Utc};
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What one sweep did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sweep {
    /// Rows deleted.
    Deleted(u64),
    /// Another instance was sweeping this consumer's rows; nothing done.
    Busy,
}

/// Deletes `consumer`'s rows older than `retention`, `batch` rows per transaction, until none are
/// left. Each transaction first takes `pg_try_advisory_xact_lock` on the consumer's key, so only one
/// instance deletes at a time; a busy lock ends the sweep (the holder is doing the work).
///
/// Each batch takes the oldest rows from where the last one ended (`processed_at` at least the
/// last deleted row's), not from the start of the index: while an old snapshot holds back vacuum,
/// the index entries of every row deleted since stay, and a batch that began at the start would
/// walk all of them again, so a sweep's cost would grow with the square of what it deletes. A row
/// that commits later with an older `processed_at` than the cursor is deleted by the next sweep.
/// The rows are deleted by their `ctid` (rows here are never updated, and the statement's
/// snapshot keeps them in place), so no plan can join the batch to the whole table.
pub async fn sweep(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    retention: Duration,
    batch: i64,
    shutdown: &CancellationToken,
) -> Result<Sweep, sqlx::Error> {
    let key = format!("{schema}.processed_messages.retention:{consumer}");
    let mut total = 0u64;
    let mut cursor: Option<DateTime<Utc>> = None;
    loop {
        let mut tx = pool.begin().await?;
        let locked: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
                .bind(&key)
                .persistent(false)
                .fetch_one(&mut *tx)
                .await?;
        if !locked {
            return Ok(if total == 0 {
                Sweep::Busy
            } else {
                Sweep::Deleted(total)
            });
        }
        let (deleted, last): (i64, Option<DateTime<Utc>>) = sqlx::query_as(schema.sql(
            "WITH gone AS ( \
                 DELETE FROM {{schema}}.processed_messages WHERE ctid = ANY(ARRAY( \
                     SELECT ctid FROM {{schema}}.processed_messages \
                     WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) \
                       AND processed_at >= coalesce($4, '-infinity') \
                     ORDER BY processed_at LIMIT $3)) \
                 RETURNING processed_at \
             ) SELECT count(*), max(processed_at) FROM gone",
        ))
        .bind(consumer)
        .bind(retention.as_secs_f64())
        .bind(batch)
        .bind(cursor)
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        total += deleted as u64;
        cursor = last.or(cursor);
        if deleted < batch || shutdown.is_cancelled() {
            return Ok(Sweep::Deleted(total));
        }
    }
}

/// Runs [`sweep`] every `config.retention_interval` until `shutdown`.
pub(crate) async fn run_periodically(
    pool: PgPool,
    config: crate::Config,
    events: Events,
    shutdown: CancellationToken,
) {
    let (schema, consumer) = (&config.schema, config.name.as_str());
    let (retention, batch) = (config.retention, config.retention_batch);
    let mut tick = tokio::time::interval(config.retention_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        match sweep(&pool, schema, consumer, retention, batch, &shutdown).await {
            Ok(Sweep::Deleted(n)) => {
                events.dedup_rows_deleted(n);
                if n > 0 {
                    tracing::info!(
                        consumer,
                        deleted = n,
                        "retention sweep deleted old deduplication rows"
                    );
                }
            }
            Ok(Sweep::Busy) => tracing::debug!(consumer, "another instance is sweeping"),
            Err(e) => {
                tracing::warn!(consumer, error = %plumbing::telemetry::ErrorChain(&e), "retention sweep failed")
            }
        }
    }
}
