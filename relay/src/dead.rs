//! `relay dead list` and `relay dead requeue`: operating on rows that exhausted their attempts.

use crate::store;
use sqlx::PgPool;
use std::io::Write;
use uuid::Uuid;

/// Prints dead rows as a table, oldest first.
pub async fn list(pool: &PgPool, limit: i64, out: &mut impl Write) -> anyhow::Result<usize> {
    let rows = store::dead_rows(pool, limit).await?;
    writeln!(
        out,
        "{:<36}  {:<24}  {:<24}  {:>8}  {:<20}  last error",
        "id", "event_type", "aggregate", "attempts", "last attempt"
    )?;
    for r in &rows {
        writeln!(
            out,
            "{:<36}  {:<24}  {:<24}  {:>8}  {:<20}  {}",
            r.id,
            r.event_type,
            format!("{}/{}", r.aggregate_type, r.aggregate_id),
            r.attempts,
            r.last_attempt_at
                .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
                .unwrap_or_default(),
            r.last_error.as_deref().unwrap_or(""),
        )?;
    }
    writeln!(out, "{} dead row(s)", rows.len())?;
    Ok(rows.len())
}

/// Requeues the given dead rows, or all of them.
pub async fn requeue(pool: &PgPool, ids: Option<&[Uuid]>) -> anyhow::Result<u64> {
    Ok(store::requeue_dead(pool, ids).await?)
}
