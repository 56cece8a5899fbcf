//! Dead outbox rows (rows that exhausted their publish attempts) and the pending backlog; the
//! requeue effect.
//!
//! The rows are read and changed by the relay's functions ([`relay::dead_rows`]): the relay owns
//! `messages`. A row's version is its PostgreSQL `xmin`, so an operator who saw version V requeues
//! the row only if nobody changed it since.

use crate::error::ConsoleError;
use crate::redact;
use crate::targets::Change;
use relay::dead_rows::{RowNow, RowState, rows_now};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use utoipa::ToSchema;
use uuid::Uuid;

/// A dead row as shown (payload and headers redacted): the relay's, which owns `messages`.
pub use relay::dead_rows::DeadRow;

/// A dead row as shown: its texts, headers and payload redacted.
pub(super) fn redacted(mut r: DeadRow) -> DeadRow {
    r.event_type = redact::text(&r.event_type);
    r.aggregate_type = redact::text(&r.aggregate_type);
    r.aggregate_id = redact::text(&r.aggregate_id);
    r.last_error = r.last_error.as_deref().map(redact::text);
    r.headers = redact::value(&r.headers);
    r.payload = redact::value(&r.payload);
    r
}

/// Dead row `id` as shown (redacted); `None` when it is not dead (any more) or does not exist.
pub async fn one(
    pool: &PgPool,
    schema: &Schema,
    id: Uuid,
) -> Result<Option<DeadRow>, ConsoleError> {
    Ok(relay::dead_rows::dead_row(pool, schema, id)
        .await?
        .map(redacted))
}

/// The outbox at a glance.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Backlog {
    /// Rows waiting to be published.
    pub pending: i64,
    /// Age of the oldest pending row, in seconds (0 when none).
    pub oldest_pending_seconds: f64,
    /// Dead rows.
    pub dead: i64,
}

/// The relay's backlog figures (index probes, no scan of the outbox).
pub async fn backlog(pool: &PgPool, schema: &Schema) -> Result<Backlog, ConsoleError> {
    let b = relay::store::backlog(pool, schema).await?;
    Ok(Backlog {
        pending: b.pending,
        oldest_pending_seconds: b.oldest_age.as_secs_f64(),
        dead: b.dead,
    })
}

/// One row of a requeue, with the version the operator saw.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Item {
    pub id: Uuid,
    pub version: i64,
}

/// What a requeue would do to one row (the dry run).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Planned {
    pub id: Uuid,
    /// `requeue`, `stale` (changed since the version seen), `not_dead`, `unpublishable`, `not_found`.
    pub would: String,
    pub detail: Option<String>,
}

fn judge(item: &Item, cur: Option<&RowNow>) -> Planned {
    let (would, detail) = match cur {
        None => ("not_found", None),
        Some(c) if c.version != item.version => (
            "stale",
            Some(format!(
                "the row changed since version {} (now {})",
                item.version, c.version
            )),
        ),
        Some(c) if c.state != RowState::Dead => {
            ("not_dead", Some(format!("the row is {}", c.state.as_str())))
        }
        Some(c) if c.unpublishable.is_some() => ("unpublishable", c.unpublishable.clone()),
        Some(_) => ("requeue", None),
    };
    Planned {
        id: item.id,
        would: would.to_string(),
        detail: detail.map(|d| redact::text(&d)),
    }
}

/// The dry run: what requeueing `items` would do, changing nothing.
pub async fn plan(
    conn: &mut PgConnection,
    schema: &Schema,
    items: &[Item],
) -> Result<Vec<Planned>, ConsoleError> {
    let ids: Vec<Uuid> = items.iter().map(|i| i.id).collect();
    let cur = rows_now(conn, schema, &ids, false).await?;
    Ok(items
        .iter()
        .map(|i| judge(i, cur.iter().find(|c| c.id == i.id)))
        .collect())
}

/// Checks that every item would be requeued now; the first that would not is the error. Gives the
/// rows as it read them (locked with `lock`, until the caller's transaction ends).
pub async fn check(
    conn: &mut PgConnection,
    schema: &Schema,
    items: &[Item],
    lock: bool,
) -> Result<Vec<RowNow>, ConsoleError> {
    let ids: Vec<Uuid> = items.iter().map(|i| i.id).collect();
    let cur = rows_now(conn, schema, &ids, lock).await?;
    for i in items {
        let p = judge(i, cur.iter().find(|c| c.id == i.id));
        let detail = p.detail.unwrap_or_default();
        match p.would.as_str() {
            "requeue" => {}
            "not_found" => return Err(ConsoleError::NotFound(format!("outbox row {}", i.id))),
            "unpublishable" => {
                return Err(ConsoleError::Unprocessable(format!(
                    "outbox row {} breaks a publishability rule and stays dead: {detail}",
                    i.id
                )));
            }
            _ => {
                return Err(ConsoleError::Conflict(format!(
                    "outbox row {}: {detail}",
                    i.id
                )));
            }
        }
    }
    Ok(cur)
}

/// The effect: every item back to pending with fresh attempts, all or none (a stale version or
/// a row that is no longer dead is a conflict and nothing changes).
pub async fn requeue(
    conn: &mut PgConnection,
    schema: &Schema,
    items: &[Item],
) -> Result<(Vec<Change>, Value), ConsoleError> {
    if items.is_empty() {
        return Err(ConsoleError::BadRequest("no rows given".into()));
    }
    let ids: Vec<Uuid> = items.iter().map(|i| i.id).collect();
    // Locked: what the requeue changes is what was checked.
    let before = check(conn, schema, items, true).await?;
    // The relay crate owns `messages`: its function writes the row and wakes the relays.
    let after = relay::dead_rows::requeue_dead_in(conn, schema, Some(&ids)).await?;
    let changes = before
        .iter()
        .map(|b| Change {
            target: format!("outbox:{}", b.id),
            before: Some(json!({"state": b.state.as_str(), "attempts": b.attempts, "last_error": b.last_error, "version": b.version})),
            after: Some(json!({
                "state": "pending",
                "attempts": 0,
                "version": after.iter().find(|(id, _)| *id == b.id).map(|(_, v)| *v),
            })),
            ..Default::default()
        })
        .collect();
    let body = json!({ "requeued": ids });
    Ok((changes, body))
}
