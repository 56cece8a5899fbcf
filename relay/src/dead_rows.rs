//! Dead rows as a person reads and requeues them: `relay dead`, and the console through these
//! functions (the relay owns `messages`; nobody else writes a query on it).
//!
//! A row's version is its PostgreSQL `xmin`: it changes with every update of the row, so an
//! operator who saw version V can act on the row only if nobody changed it since.
//!
//! Dead rows are the ones that broke a rule, so nothing in them is trusted: a `created_at` that
//! is not a finite time reads as `None` (chrono cannot hold `infinity`), texts are whatever the
//! producer wrote.

use crate::lenient_json::LenientJson;
pub use crate::row_state::RowState;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// A dead row, whole: what `relay dead list` prints and the console shows (redacted).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DeadRow {
    pub id: Uuid,
    pub seq: i64,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    /// `None` when the row's `created_at` is not a finite time (one reason a row goes dead).
    pub created_at: Option<DateTime<Utc>>,
    /// The row version to send with an action.
    pub version: i64,
    /// The first publishability rule the row breaks, if any: such a row cannot be requeued.
    pub unpublishable: Option<String>,
    /// The headers as JSON, or a text saying why they cannot be shown (see [`LenientJson`]).
    #[sqlx(try_from = "LenientJson")]
    pub headers: Value,
    /// The payload as JSON, or a text saying why it cannot be shown.
    #[sqlx(try_from = "LenientJson")]
    pub payload: Value,
}

/// The columns of a [`DeadRow`], then `rest` after `WHERE state = 'dead'` (more conditions, the
/// order, the limit).
fn select_dead(rest: &str) -> String {
    format!(
        "SELECT id, seq, event_type, aggregate_type, aggregate_id, attempts, last_error, last_attempt_at, \
                CASE WHEN isfinite(created_at) THEN created_at END AS created_at, \
                xmin::text::bigint AS version, \
                {{{{schema}}}}.unpublishable_reason(event_type, aggregate_type, aggregate_id, created_at, headers) AS unpublishable, \
                headers::text AS headers, payload::text AS payload \
         FROM {{{{schema}}}}.messages WHERE state = 'dead' {rest}"
    )
}

/// Dead rows, oldest first, at most `limit`.
pub async fn dead_rows(
    pool: &PgPool,
    schema: &Schema,
    limit: i64,
) -> Result<Vec<DeadRow>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let rows = rows_after(&mut tx, schema, None, limit).await?;
    tx.commit().await?;
    Ok(rows)
}

/// Dead row `id`, whole; `None` when no row has that id or it is not dead (requeued, published).
pub async fn dead_row(
    pool: &PgPool,
    schema: &Schema,
    id: Uuid,
) -> Result<Option<DeadRow>, sqlx::Error> {
    sqlx::query_as::<_, DeadRow>(schema.sql(&select_dead("AND id = $1")))
        .bind(id)
        .persistent(false)
        .fetch_optional(pool)
        .await
}

/// A page of dead rows: at most `limit` after `seq` `after` (keyset pages over the partial index
/// `messages_dead_idx`), and how many rows are dead in all, read in one transaction (the count
/// agrees with the page).
pub async fn dead_page(
    pool: &PgPool,
    schema: &Schema,
    after: Option<i64>,
    limit: i64,
) -> Result<(Vec<DeadRow>, i64), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let rows = rows_after(&mut tx, schema, after, limit).await?;
    let total = sqlx::query_scalar(
        schema.sql("SELECT count(*) FROM {{schema}}.messages WHERE state = 'dead'"),
    )
    .persistent(false)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((rows, total))
}

async fn rows_after(
    conn: &mut PgConnection,
    schema: &Schema,
    after: Option<i64>,
    limit: i64,
) -> Result<Vec<DeadRow>, sqlx::Error> {
    sqlx::query_as::<_, DeadRow>(schema.sql(&select_dead(
        "AND ($1::bigint IS NULL OR seq > $1) ORDER BY seq LIMIT $2",
    )))
    .bind(after)
    .bind(limit.max(0))
    .persistent(false)
    .fetch_all(conn)
    .await
}

/// Each dead row's id and version, oldest first, at most `limit`: what a request for "all that
/// match" freezes.
pub async fn dead_versions(
    pool: &PgPool,
    schema: &Schema,
    limit: i64,
) -> Result<Vec<(Uuid, i64)>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query_as(schema.sql(
        "SELECT id, xmin::text::bigint FROM {{schema}}.messages WHERE state = 'dead' ORDER BY seq LIMIT $1",
    ))
    .bind(limit.max(0))
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows)
}

/// A row as it is now, for deciding whether a requeue may touch it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct RowNow {
    pub id: Uuid,
    pub version: i64,
    #[sqlx(try_from = "String")]
    pub state: RowState,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub unpublishable: Option<String>,
}

/// The rows among `ids` as they are now, in `seq` order, inside the caller's transaction;
/// `lock` takes their row locks until it ends (a requeue checks and changes the same rows).
pub async fn rows_now(
    conn: &mut PgConnection,
    schema: &Schema,
    ids: &[Uuid],
    lock: bool,
) -> Result<Vec<RowNow>, sqlx::Error> {
    let sql = format!(
        "SELECT id, xmin::text::bigint AS version, state, attempts, last_error, \
                {{{{schema}}}}.unpublishable_reason(event_type, aggregate_type, aggregate_id, created_at, headers) AS unpublishable \
         FROM {{{{schema}}}}.messages WHERE id = ANY($1) ORDER BY seq{}",
        if lock { " FOR UPDATE" } else { "" }
    );
    sqlx::query_as::<_, RowNow>(schema.sql(&sql))
        .bind(ids)
        .persistent(false)
        .fetch_all(&mut *conn)
        .await
}

/// What a requeue did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requeued {
    /// Rows put back to pending.
    pub requeued: u64,
    /// Dead rows left dead because they still break a publishability rule, with the rule.
    pub still_unpublishable: Vec<(Uuid, String)>,
}

/// Puts dead rows back to pending with fresh attempts (all of them when `ids` is `None`) and wakes
/// the relays. Rows that still break a publishability rule stay dead (fix them first) and are
/// reported, so one of them never blocks the rest.
pub async fn requeue_dead(
    pool: &PgPool,
    schema: &Schema,
    ids: Option<&[Uuid]>,
) -> Result<Requeued, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let requeued = requeue_dead_in(&mut tx, schema, ids).await?.len() as u64;
    let still: Vec<(Uuid, String)> = sqlx::query_as(
        schema.sql("SELECT id, {{schema}}.unpublishable_reason(event_type, aggregate_type, aggregate_id, created_at, headers) \
         FROM {{schema}}.messages WHERE state = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1)) \
           AND {{schema}}.unpublishable_reason(event_type, aggregate_type, aggregate_id, created_at, headers) IS NOT NULL \
         ORDER BY seq"),
    )
    .bind(ids)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Requeued {
        requeued,
        still_unpublishable: still,
    })
}

/// [`requeue_dead`]'s update inside the caller's transaction, which it does not commit: a caller
/// that records the requeue elsewhere (the console's audit log) commits both or neither. Dead
/// rows among `ids` (all dead rows when `None`) that break no publishability rule go back to
/// pending with fresh attempts, and the relays are woken when the transaction commits. Returns
/// each requeued row's id and its new row version (`xmin`).
pub async fn requeue_dead_in(
    conn: &mut PgConnection,
    schema: &Schema,
    ids: Option<&[Uuid]>,
) -> Result<Vec<(Uuid, i64)>, sqlx::Error> {
    let requeued: Vec<(Uuid, i64)> = sqlx::query_as(
        schema.sql("UPDATE {{schema}}.messages SET state = 'pending', attempts = 0 \
         WHERE state = 'dead' AND ($1::uuid[] IS NULL OR id = ANY($1)) \
           AND {{schema}}.unpublishable_reason(event_type, aggregate_type, aggregate_id, created_at, headers) IS NULL \
         RETURNING id, xmin::text::bigint"),
    )
    .bind(ids)
    .persistent(false)
    .fetch_all(&mut *conn)
    .await?;
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(schema.notify_channel())
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    Ok(requeued)
}
