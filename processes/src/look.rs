//! What a person looking at processes needs beyond [`crate::admin`]'s views: the business name
//! of each compensation, the manual-review backlog with the age of its oldest entry, and the
//! processes of a business key (for links from an order or payment to its processes). Read-only.

use chrono::{DateTime, Utc};
use serde::Serialize;
use shared::schema::Schema;
use sqlx::{PgPool, Row};
use uuid::Uuid;

/// The labels of a process's compensation steps that have one (`compensation_label`, from
/// [`crate::Step::compensate_as`]), by step seq.
pub async fn compensation_labels(
    pool: &PgPool,
    schema: &Schema,
    id: Uuid,
) -> Result<Vec<(i32, String)>, sqlx::Error> {
    sqlx::query_as(schema.sql(
        "SELECT seq, compensation_label FROM {{schema}}.process_steps \
         WHERE process_id = $1 AND compensation_label IS NOT NULL ORDER BY seq",
    ))
    .bind(id)
    .fetch_all(pool)
    .await
}

/// Processes waiting for a person.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReviewBacklog {
    /// Processes in manual review now.
    pub count: i64,
    /// When the one waiting longest went into manual review (`None` when none waits).
    pub oldest_since: Option<DateTime<Utc>>,
}

/// The manual-review backlog: how many, and since when the oldest waits (its last transition
/// into `manual_review`, from the history).
pub async fn review_backlog(pool: &PgPool, schema: &Schema) -> Result<ReviewBacklog, sqlx::Error> {
    let row = sqlx::query(schema.sql(
        "SELECT count(*) AS count, min(coalesce(h.at, p.updated_at)) AS oldest \
         FROM {{schema}}.processes p \
         LEFT JOIN LATERAL (SELECT max(at) AS at FROM {{schema}}.process_history \
             WHERE process_id = p.id AND step_seq IS NULL AND to_status = 'manual_review') h ON true \
         WHERE p.status = 'manual_review'",
    ))
    .fetch_one(pool)
    .await?;
    Ok(ReviewBacklog {
        count: row.try_get("count")?,
        oldest_since: row.try_get("oldest")?,
    })
}

/// A process of a business key, as a link names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyedProcess {
    pub id: Uuid,
    pub kind: String,
    pub status: String,
    pub business_key: String,
}

/// The processes (at most 50, newest first) whose business key is `key` (a payment's process from
/// the payment's id): an index lookup, never a scan of inputs.
pub async fn of_key(
    pool: &PgPool,
    schema: &Schema,
    key: &str,
) -> Result<Vec<KeyedProcess>, sqlx::Error> {
    let rows = sqlx::query(schema.sql(
        "SELECT id, kind, status, business_key FROM {{schema}}.processes \
         WHERE business_key = $1 \
         ORDER BY created_at DESC LIMIT 50",
    ))
    .bind(key)
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(|r| {
            Ok(KeyedProcess {
                id: r.try_get("id")?,
                kind: r.try_get("kind")?,
                status: r.try_get("status")?,
                business_key: r.try_get("business_key")?,
            })
        })
        .collect()
}

/// Processes of one kind whose step waits for a dependency (its circuit or its limits).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DependencyWaiters {
    pub dependency: String,
    pub kind: String,
    pub count: i64,
    /// Since when the longest-waiting of them has waited for the remote.
    pub oldest_since: Option<DateTime<Utc>>,
}

/// The steps waiting for each dependency, by process kind ("provider: 478 payment processes
/// waiting since 12:03"), read through the wake-up's index.
pub async fn waiting_for_dependencies(
    pool: &PgPool,
    schema: &Schema,
) -> Result<Vec<DependencyWaiters>, sqlx::Error> {
    let rows = sqlx::query(schema.sql(
        "SELECT s.waiting_for, p.kind, count(*) AS n, min(s.waiting_since) AS oldest \
         FROM {{schema}}.process_steps s JOIN {{schema}}.processes p ON p.id = s.process_id \
         WHERE s.waiting_for IS NOT NULL GROUP BY 1, 2 ORDER BY 1, 2",
    ))
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(DependencyWaiters {
                dependency: r.try_get("waiting_for")?,
                kind: r.try_get("kind")?,
                count: r.try_get("n")?,
                oldest_since: r.try_get("oldest")?,
            })
        })
        .collect()
}
