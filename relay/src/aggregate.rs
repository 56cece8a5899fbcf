//! The outbox messages of one aggregate (an order's, a payment's events), for a person following
//! a link from a process or a dead letter to the events of the thing it names. Read-only.
//!
//! There is no index on `aggregate_id` (one would cost every producer insert): the lookup scans
//! the retained rows, which the retention sweep keeps bounded; it is for a person's click, not
//! for a hot path.

use crate::lenient_json::LenientJson;
use crate::row_state::RowState;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use shared::schema::Schema;
use sqlx::PgPool;
use uuid::Uuid;

/// One message of the aggregate, as a person reads it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AggregateMessage {
    pub seq: i64,
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// Position within the aggregate (`None` for rows written before positions existed).
    pub aggregate_seq: Option<i64>,
    pub event_type: String,
    #[sqlx(try_from = "String")]
    pub state: RowState,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// `None` when the row's `created_at` is not a finite time.
    pub created_at: Option<DateTime<Utc>>,
    pub published_at: Option<DateTime<Utc>>,
    /// As JSON, or a text saying why it cannot be shown (a dead row may nest too deep to read).
    #[sqlx(try_from = "LenientJson")]
    pub headers: Value,
    #[sqlx(try_from = "LenientJson")]
    pub payload: Value,
}

/// The newest `limit` messages (at most 500) whose aggregate id is `aggregate_id`, newest first.
pub async fn messages_of(
    pool: &PgPool,
    schema: &Schema,
    aggregate_id: &str,
    limit: i64,
) -> Result<Vec<AggregateMessage>, sqlx::Error> {
    sqlx::query_as(schema.sql(
        "SELECT seq, id, aggregate_type, aggregate_id, aggregate_seq, event_type, state, attempts, last_error, \
                CASE WHEN isfinite(created_at) THEN created_at END AS created_at, published_at, \
                headers::text AS headers, payload::text AS payload \
         FROM {{schema}}.messages WHERE aggregate_id = $1 ORDER BY seq DESC LIMIT $2",
    ))
    .bind(aggregate_id)
    .bind(limit.clamp(1, 500))
    .fetch_all(pool)
    .await
}
