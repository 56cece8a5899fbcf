//! The inbox: `{{schema}}.webhook_inbox`, one row per (source, event id), and
//! `{{schema}}.webhook_objects`, the highest position applied per (source, object). Every
//! statement the receiver runs on them, all inside the event's one transaction.

use crate::webhooks::event::WebhookEvent;
use crate::webhooks::handler::ObjectVersion;
use chrono::{DateTime, Utc};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};

/// What became of an event that was not refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InboxOutcome {
    /// New, and the handler's effect committed with its row.
    Applied,
    /// New, but not newer than what its object already has: recorded, handler not run.
    Superseded,
    /// Received before: nothing changed.
    Duplicate,
}

impl InboxOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            InboxOutcome::Applied => "applied",
            InboxOutcome::Superseded => "superseded",
            InboxOutcome::Duplicate => "duplicate",
        }
    }
}

/// Inserts the event's row unless its id is there already; `false` for a duplicate. A concurrent
/// delivery of the same event waits here for the first one's transaction: after its commit this
/// one is a duplicate, after its rollback this one inserts.
pub async fn insert(
    conn: &mut PgConnection,
    schema: &Schema,
    source: &str,
    event: &WebhookEvent,
    version: Option<&ObjectVersion>,
) -> Result<bool, sqlx::Error> {
    let inserted: Option<bool> = sqlx::query_scalar(schema.sql(
        "INSERT INTO {{schema}}.webhook_inbox
                (source, event_id, event_type, object_key, position, outcome, occurred_at, signed_at, payload)
         VALUES ($1, $2, $3, $4, $5, 'applied', $6, $7, $8)
         ON CONFLICT (source, event_id) DO NOTHING
         RETURNING true",
    ))
    .bind(source)
    .bind(&event.id)
    .bind(&event.kind)
    .bind(version.map(|v| v.object.as_str()))
    .bind(version.map(|v| v.position))
    .bind(event.created)
    .bind(event.signed_at)
    .bind(&event.raw)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(inserted.unwrap_or(false))
}

/// Moves the object to `version.position` if that is higher than what it has (or it is new);
/// `false` if the event is superseded. The conflicting row stays locked until the transaction
/// ends, so two events of one object are decided one after the other.
pub async fn advance(
    conn: &mut PgConnection,
    schema: &Schema,
    source: &str,
    event_id: &str,
    version: &ObjectVersion,
) -> Result<bool, sqlx::Error> {
    let advanced: Option<bool> = sqlx::query_scalar(schema.sql(
        "INSERT INTO {{schema}}.webhook_objects (source, object_key, position, event_id)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (source, object_key) DO UPDATE
            SET position = EXCLUDED.position, event_id = EXCLUDED.event_id, updated_at = now()
          WHERE webhook_objects.position < EXCLUDED.position
         RETURNING true",
    ))
    .bind(source)
    .bind(&version.object)
    .bind(version.position)
    .bind(event_id)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(advanced.unwrap_or(false))
}

/// Records that the event was superseded (its handler did not run).
pub async fn mark_superseded(
    conn: &mut PgConnection,
    schema: &Schema,
    source: &str,
    event_id: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.webhook_inbox SET outcome = 'superseded'
          WHERE source = $1 AND event_id = $2",
    ))
    .bind(source)
    .bind(event_id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Deletes inbox rows received before `before`, `batch` rows per statement, until none is left;
/// returns how many. Run it with a horizon well beyond the providers' retry period (Stripe
/// retries for 3 days): a redelivery older than the horizon would be applied again. The rows of
/// `webhook_objects` stay (one per object): they keep ordering old events out.
pub async fn purge(
    pool: &PgPool,
    schema: &Schema,
    before: DateTime<Utc>,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    // Each statement goes on from the last one's newest row, not from the start of the index:
    // under an old snapshot the entries of rows deleted since stay, and walking them again in
    // every statement would make a purge's cost grow with the square of what it deletes. The rows
    // go by `ctid` (an array, so no plan joins the batch to the whole table).
    let mut cursor: Option<DateTime<Utc>> = None;
    loop {
        let (n, last): (i64, Option<DateTime<Utc>>) = sqlx::query_as(schema.sql(
            "WITH gone AS ( \
                 DELETE FROM {{schema}}.webhook_inbox WHERE ctid = ANY(ARRAY( \
                     SELECT ctid FROM {{schema}}.webhook_inbox \
                     WHERE received_at < $1 AND received_at >= coalesce($3, '-infinity') \
                     ORDER BY received_at LIMIT $2)) \
                 RETURNING received_at \
             ) SELECT count(*), max(received_at) FROM gone",
        ))
        .bind(before)
        .bind(batch.max(1))
        .bind(cursor)
        .fetch_one(pool)
        .await?;
        total += n as u64;
        cursor = last.or(cursor);
        if n == 0 {
            return Ok(total);
        }
    }
}

/// Runs [`purge`] every `interval` with the horizon `now - retention`, until `shutdown`. A failed
/// run is logged and tried again at the next interval (it deletes nothing it should keep: the
/// horizon only moves forward).
pub async fn purge_loop(
    pool: PgPool,
    schema: Schema,
    retention: std::time::Duration,
    interval: std::time::Duration,
    batch: i64,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let before = Utc::now()
            .checked_sub_signed(retention)
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        match purge(&pool, &schema, before, batch).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, %before, "webhook inbox purged"),
            Err(e) => tracing::warn!(error = %e, "webhook inbox purge failed; next run retries"),
        }
    }
}
