//! The audit log: one append-only row per action and per denied attempt, written in the action's
//! own transaction. The database refuses UPDATE, DELETE and TRUNCATE on it (triggers of migration
//! 0006); [`purge`] calls `purge_console_audit(retention)`, the only way rows go.

use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::{redact, text};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use shared::schema::Schema;
use sqlx::error::BoxDynError;
use sqlx::postgres::PgArguments;
use sqlx::{Arguments, PgConnection, PgPool};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// Outcomes an entry records (the CHECK of `console_audit.outcome`).
pub mod outcome {
    pub const SUCCEEDED: &str = "succeeded";
    pub const REQUESTED: &str = "requested";
    pub const APPROVED: &str = "approved";
    pub const REJECTED: &str = "rejected";
    pub const DENIED: &str = "denied";
    pub const CONFLICT: &str = "conflict";
}

/// An entry to write.
#[derive(Debug, Clone)]
pub struct NewEntry {
    pub actor: Principal,
    pub action: String,
    pub target: String,
    pub reason: String,
    pub approval_id: Option<Uuid>,
    pub approver: Option<String>,
    pub before: Option<Value>,
    pub after: Option<Value>,
    pub outcome: &'static str,
}

/// A stored entry.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct Entry {
    pub seq: i64,
    pub at: DateTime<Utc>,
    pub actor_id: Option<Uuid>,
    pub actor_name: String,
    pub roles: Vec<String>,
    pub action: String,
    pub target: String,
    pub reason: String,
    pub approval_id: Option<Uuid>,
    pub approver: Option<String>,
    pub before: Option<Value>,
    pub after: Option<Value>,
    pub outcome: String,
}

/// Filters of `GET /api/audit`.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
pub struct Filter {
    /// Only this actor (user name).
    pub actor: Option<String>,
    /// Only this action (e.g. `outbox.requeue`).
    pub action: Option<String>,
    /// Only this outcome (e.g. `denied`).
    pub outcome: Option<String>,
    /// Targets containing this text.
    pub target: Option<String>,
    /// Entries at or after this time (RFC 3339).
    pub since: Option<DateTime<Utc>>,
    /// At most this many (default 200, newest first).
    pub limit: Option<i64>,
    /// `jsonl` for JSON lines, oldest first (export).
    pub format: Option<String>,
    /// The `next` of the previous page (JSON pages only; the export is whole).
    pub after: Option<String>,
}

/// The columns of an [`Entry`].
pub(super) const COLUMNS: &str = "seq, at, actor_id, actor_name, roles, action, target, reason, approval_id, approver, before, after, outcome";

/// The conditions of a [`Filter`]: its [`Filter::arguments`] are `$1` to `$5`.
pub(super) const FILTERED: &str = "WHERE ($1::text IS NULL OR actor_name = $1) AND ($2::text IS NULL OR action = $2) \
    AND ($3::text IS NULL OR outcome = $3) AND ($4::text IS NULL OR strpos(target, $4) > 0) \
    AND ($5::timestamptz IS NULL OR at >= $5)";

/// Appends `e` (redacted) on `conn`, inside the caller's transaction.
pub async fn record(
    conn: &mut PgConnection,
    schema: &Schema,
    e: &NewEntry,
) -> Result<(), ConsoleError> {
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.console_audit \
         (actor_id, actor_name, roles, action, target, reason, approval_id, approver, before, after, outcome) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    ))
    // Printable: whatever a refused caller sent, its entry can be written (text::printable).
    .bind(e.actor.id)
    .bind(text::printable(&e.actor.name))
    .bind(e.actor.role.held())
    .bind(text::printable(&e.action))
    .bind(text::printable(&redact::text(&e.target)))
    .bind(text::printable(&redact::text(&e.reason)))
    .bind(e.approval_id)
    .bind(e.approver.as_deref().map(text::printable))
    .bind(e.before.as_ref().map(|v| text::printable_value(&redact::value(v))))
    .bind(e.after.as_ref().map(|v| text::printable_value(&redact::value(v))))
    .bind(e.outcome)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Filter {
    /// No control character in any text filter (400).
    pub fn check(&self) -> Result<(), ConsoleError> {
        text::check_all([
            ("actor", self.actor.as_deref()),
            ("action", self.action.as_deref()),
            ("outcome", self.outcome.as_deref()),
            ("target", self.target.as_deref()),
            ("format", self.format.as_deref()),
            ("after", self.after.as_deref()),
        ])
    }

    /// The filters as `$1` to `$5` of [`FILTERED`]; a query binds its own after them.
    pub(super) fn arguments(&self) -> Result<PgArguments, ConsoleError> {
        let internal = |e: BoxDynError| ConsoleError::Internal(e.to_string());
        let mut a = PgArguments::default();
        a.add(&self.actor).map_err(internal)?;
        a.add(&self.action).map_err(internal)?;
        a.add(&self.outcome).map_err(internal)?;
        a.add(&self.target).map_err(internal)?;
        a.add(self.since).map_err(internal)?;
        Ok(a)
    }
}

/// Entries matching `f`: newest first, or oldest first for export.
pub async fn list(
    pool: &PgPool,
    schema: &Schema,
    f: &Filter,
    oldest_first: bool,
) -> Result<Vec<Entry>, ConsoleError> {
    let limit = f
        .limit
        .unwrap_or(if oldest_first { 100_000 } else { 200 })
        .clamp(1, 100_000);
    let order = if oldest_first { "ASC" } else { "DESC" };
    let sql = format!(
        "SELECT {COLUMNS} FROM {{{{schema}}}}.console_audit {FILTERED} ORDER BY seq {order} LIMIT $6"
    );
    let rows = sqlx::query_as_with::<_, Entry, _>(schema.sql(&sql), f.arguments()?)
        .bind(limit)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(redacted).collect())
}

/// The entries about one item, oldest first (at most 1,000): those `direct` selects (its own
/// actions, denied and conflicting attempts included) and those of the approval requests
/// `requested` selects (the request, its decision). Both conditions read `$1` and `$2`, `args`.
async fn about(
    pool: &PgPool,
    schema: &Schema,
    direct: &str,
    requested: &str,
    args: [&str; 2],
) -> Result<Vec<Entry>, ConsoleError> {
    let rows = sqlx::query_as::<_, Entry>(schema.sql(&format!(
        "SELECT {COLUMNS} FROM {{{{schema}}}}.console_audit WHERE ({direct}) \
            OR approval_id IN (SELECT id FROM {{{{schema}}}}.console_approvals WHERE {requested}) \
         ORDER BY seq LIMIT 1000"
    )))
    .bind(args[0])
    .bind(args[1])
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(redacted).collect())
}

/// The entries about process `id`, oldest first: its actions (denied and conflicting attempts
/// included) and the decisions on approval requests for it.
pub async fn of_process(
    pool: &PgPool,
    schema: &Schema,
    id: Uuid,
) -> Result<Vec<Entry>, ConsoleError> {
    let id = id.to_string();
    about(
        pool,
        schema,
        "target = 'process:' || $1",
        "request->>'kind' = 'process' AND request->>'id' = $1",
        [&id, ""],
    )
    .await
}

/// The entries that acted on dead outbox row `id`: a requeue of it alone or in a list, and the
/// approval requests that name it with their decisions.
pub async fn of_outbox_row(
    pool: &PgPool,
    schema: &Schema,
    id: Uuid,
) -> Result<Vec<Entry>, ConsoleError> {
    let id = id.to_string();
    about(
        pool,
        schema,
        "action = 'outbox.requeue' AND strpos(target, $1) > 0",
        "request->>'kind' = 'outbox_requeue' \
         AND request->'items' @> jsonb_build_array(jsonb_build_object('id', $1))",
        [&id, ""],
    )
    .await
}

/// The entries that acted on dead letter `message_id` of `consumer`: its replays, alone or in a
/// list, and the approval requests that name it with their decisions.
pub async fn of_dead_letter(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    message_id: &str,
) -> Result<Vec<Entry>, ConsoleError> {
    about(
        pool,
        schema,
        "action = 'dlq.replay' AND starts_with(target, 'dlq:' || $1 || '/') AND strpos(target, $2) > 0",
        "request->>'kind' = 'dlq_replay' AND request->>'consumer' = $1 \
         AND request->'items' @> jsonb_build_array(jsonb_build_object('message_id', $2))",
        [consumer, message_id],
    )
    .await
}

/// An entry as shown: redacted again on the way out (declared fields may have grown since).
pub(super) fn redacted(mut e: Entry) -> Entry {
    e.target = redact::text(&e.target);
    e.reason = redact::text(&e.reason);
    e.before = e.before.as_ref().map(redact::value);
    e.after = e.after.as_ref().map(redact::value);
    e
}

/// Deletes entries older than `retention_days` through `purge_console_audit`; returns how many.
pub async fn purge(
    conn: &mut PgConnection,
    schema: &Schema,
    retention_days: u32,
) -> Result<i64, ConsoleError> {
    Ok(sqlx::query_scalar(
        schema.sql("SELECT {{schema}}.purge_console_audit(make_interval(days => $1))"),
    )
    .bind(retention_days as i32)
    .fetch_one(&mut *conn)
    .await?)
}
