//! `relay dead list` and `relay dead requeue`: operating on rows that exhausted their attempts.

use crate::dead_rows;
use shared::display::escape_control as esc;
use shared::schema::Schema;
use sqlx::PgPool;
use std::io::Write;
use uuid::Uuid;

/// Prints dead rows as a table, oldest first. Every value from a row is escaped
/// ([`shared::display::escape_control`]): a newline in an id cannot forge a line.
pub async fn list(
    pool: &PgPool,
    schema: &Schema,
    limit: i64,
    out: &mut impl Write,
) -> anyhow::Result<usize> {
    let rows = dead_rows::dead_rows(pool, schema, limit).await?;
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
            esc(&r.event_type),
            format!("{}/{}", esc(&r.aggregate_type), esc(&r.aggregate_id)),
            r.attempts,
            r.last_attempt_at
                .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
                .unwrap_or_default(),
            esc(r.last_error.as_deref().unwrap_or("")),
        )?;
    }
    writeln!(out, "{} dead row(s)", rows.len())?;
    Ok(rows.len())
}

/// Requeues the given dead rows, or all of them, and prints what it did; rows that still break a
/// publishability rule stay dead and are listed with the rule.
pub async fn requeue(
    pool: &PgPool,
    schema: &Schema,
    ids: Option<&[Uuid]>,
    out: &mut impl Write,
) -> anyhow::Result<dead_rows::Requeued> {
    let done = dead_rows::requeue_dead(pool, schema, ids).await?;
    writeln!(out, "{} row(s) requeued", done.requeued)?;
    for (id, why) in &done.still_unpublishable {
        writeln!(out, "  {id} stays dead: {}", esc(why))?;
    }
    Ok(done)
}
