//! The counter purge: deletes closed rows of `aggregate_sequences`.
//!
//! Since migration 26 an aggregate's counter row takes at most 32 updates; the transaction that
//! finds it full closes it and goes on in a new row, so that no version chain grows without bound
//! while an old snapshot is held (issue 39). A closed row carries nothing anyone reads again. They
//! are deleted here through their partial index, in key order, a bounded batch per statement; an
//! aggregate's first row is kept (see the migration), the current row is never closed.
//!
//! Every relay instance runs it; two passes over the same rows are harmless (a row deleted by one
//! is skipped by the other). A pass reads each closed row once, the deleted ones an old snapshot
//! keeps included.

use plumbing::telemetry::ErrorChain;
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Closed rows looked at per statement.
const BATCH: i64 = 5_000;

/// How often a pass starts. Closed rows cost space, not time (producers read the top entry of an
/// aggregate only), so once a minute is enough.
const EVERY: Duration = Duration::from_secs(60);

/// A position in the primary key: (aggregate_type, aggregate_id, first_seq).
type Key = (String, String, i64);

/// Runs a pass every [`EVERY`] until `stop`, first one shortly after start.
pub async fn purge_loop(pool: PgPool, schema: Schema, stop: CancellationToken) {
    let mut wait = Duration::from_secs(5);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => return,
        }
        wait = EVERY;
        match pass(&pool, &schema, &stop).await {
            Ok(n) if n > 0 => tracing::debug!(deleted = n, "counter purge"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "purging closed counter rows failed"),
        }
    }
}

/// One walk over the closed rows; returns how many it deleted. Stops early (at a batch's end) when
/// `stop` is cancelled.
pub async fn pass(
    pool: &PgPool,
    schema: &Schema,
    stop: &CancellationToken,
) -> Result<u64, sqlx::Error> {
    let mut after: Option<Key> = None;
    let mut deleted = 0;
    loop {
        let (n, last) = plumbing::db::bounded(purge_batch(pool, schema, after.as_ref())).await?;
        deleted += n;
        match last {
            Some(k) if !stop.is_cancelled() => after = Some(k),
            _ => return Ok(deleted),
        }
    }
}

/// Deletes the next [`BATCH`] closed rows after `after` (an aggregate's first row excepted);
/// returns how many it deleted and the last key it looked at (`None` at the end).
async fn purge_batch(
    pool: &PgPool,
    schema: &Schema,
    after: Option<&Key>,
) -> Result<(u64, Option<Key>), sqlx::Error> {
    let (t, i, f) = match after {
        Some((t, i, f)) => (Some(t.as_str()), Some(i.as_str()), *f),
        None => (None, None, -1),
    };
    let row: (i64, Option<String>, Option<String>, Option<i64>, i64) = sqlx::query_as(schema.sql(
        "WITH batch AS ( \
             SELECT aggregate_type, aggregate_id, first_seq FROM {{schema}}.aggregate_sequences \
             WHERE closed AND first_seq > 1 \
               AND ($1::text IS NULL \
                    OR (aggregate_type, aggregate_id, first_seq) > ($1::text, $2::text, $3::bigint)) \
             ORDER BY aggregate_type, aggregate_id, first_seq LIMIT $4), \
         gone AS ( \
             DELETE FROM {{schema}}.aggregate_sequences s USING batch b \
             WHERE s.aggregate_type = b.aggregate_type AND s.aggregate_id = b.aggregate_id \
               AND s.first_seq = b.first_seq AND s.closed \
             RETURNING 1), \
         last AS ( \
             SELECT aggregate_type, aggregate_id, first_seq FROM batch \
             ORDER BY aggregate_type DESC, aggregate_id DESC, first_seq DESC LIMIT 1) \
         SELECT (SELECT count(*) FROM gone), l.aggregate_type, l.aggregate_id, l.first_seq, \
                (SELECT count(*) FROM batch) \
         FROM (SELECT 1) one LEFT JOIN last l ON true",
    ))
    .bind(t)
    .bind(i)
    .bind(f)
    .bind(BATCH)
    .persistent(false)
    .fetch_one(pool)
    .await?;
    let (deleted, lt, li, lf, seen) = row;
    let last = match (lt, li, lf) {
        (Some(t), Some(i), Some(f)) if seen >= BATCH => Some((t, i, f)),
        _ => None,
    };
    Ok((deleted as u64, last))
}
