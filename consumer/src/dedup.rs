//! The deduplication record: `processed_messages (consumer, message_id)`, written in the
//! transaction of the effect.
//!
//! Behind a transaction pooler (PgBouncer before 1.21), which does not keep named prepared
//! statements across transactions, they run unnamed ([`crate::Config::named_statements`]); the
//! runtime's other statements are simple-protocol or unnamed always (docs/operations.md).

use shared::schema::Schema;
use sqlx::PgConnection;
use std::collections::HashSet;
use uuid::Uuid;

/// Records `ids` as processed by `consumer` and returns those that were not recorded yet: the
/// messages whose handler runs now. One statement for the whole batch; `ids` are sorted so that
/// concurrent batches lock index entries in the same order (no deadlock between them).
///
/// A row inserted by a concurrent, uncommitted transaction makes this statement wait for it: if
/// that transaction commits, the id is a duplicate here; if it rolls back, it is ours.
pub async fn claim(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    ids: &[Uuid],
    named: bool,
) -> Result<HashSet<Uuid>, sqlx::Error> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let fresh: Vec<Uuid> = sqlx::query_scalar(schema.sql(
        "INSERT INTO {{schema}}.processed_messages (consumer, message_id) \
         SELECT $1, id FROM unnest($2::uuid[]) AS t(id) \
         ON CONFLICT (consumer, message_id) DO NOTHING \
         RETURNING message_id",
    ))
    .bind(consumer)
    .bind(&sorted)
    .persistent(named)
    .fetch_all(&mut *conn)
    .await?;
    Ok(fresh.into_iter().collect())
}

/// Removes the records of messages whose handler failed in this transaction (their effect was
/// rolled back to a savepoint, so they must be processed again when retried).
pub async fn unclaim(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    ids: &[Uuid],
    named: bool,
) -> Result<(), sqlx::Error> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query(
        schema.sql("DELETE FROM {{schema}}.processed_messages WHERE consumer = $1 AND message_id = ANY($2::uuid[])"),
    )
    .bind(consumer)
    .bind(ids)
    .persistent(named)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Whether a database error is an infrastructure failure (connection, resources, deadlock,
/// serialization, administrator action) rather than something this message caused. Those roll the
/// whole batch back and retry it with backoff; nothing is dead-lettered for them.
pub fn is_infrastructure(e: &sqlx::Error) -> bool {
    // PostgreSQL unavailable (plumbing's rule), or a transaction PostgreSQL rolled back for its
    // own reasons: 40 (deadlock, serialization), 55P03 (lock timeout). 57014 (statement timeout)
    // is left to the message: a query that always times out must not stall the queue.
    plumbing::db::is_unavailable(e)
        || matches!(e, sqlx::Error::Database(db)
            if db.code().is_some_and(|c| c.starts_with("40") || c == "55P03"))
}
