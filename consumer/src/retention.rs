//! Deletes old deduplication rows in bounded batches, one instance at a time.

use crate::internal_events::Events;
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
        let deleted = sqlx::query(schema.sql(
            "DELETE FROM {{schema}}.processed_messages p USING ( \
                 SELECT consumer, message_id FROM {{schema}}.processed_messages \
                 WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2) \
                 LIMIT $3 \
             ) old \
             WHERE p.consumer = old.consumer AND p.message_id = old.message_id",
        ))
        .bind(consumer)
        .bind(retention.as_secs_f64())
        .bind(batch)
        .persistent(false)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        total += deleted;
        if deleted < batch as u64 || shutdown.is_cancelled() {
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
