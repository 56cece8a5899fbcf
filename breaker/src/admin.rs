//! What operators see of dependencies and may do: list them with their circuits, hold a circuit
//! open by hand (a remote known to be broken, a planned maintenance) and close it again. Each
//! action names its actor and reason and lands in `dependency_history` (append-only, written by a
//! trigger in the action's transaction).

use crate::circuit::Circuit;
use crate::error::AdminError;
use crate::state::CircuitState;
use crate::store;
use chrono::{DateTime, Utc};
use serde::Serialize;
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool, Row};

/// A dependency as an operator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct DependencyView {
    pub name: String,
    pub state: CircuitState,
    pub forced_open: bool,
    /// When the current outage began (None while closed).
    pub down_since: Option<DateTime<Utc>>,
    /// While open: the next probe.
    pub probe_at: Option<DateTime<Utc>>,
    pub consecutive: i32,
    pub cooldown_ms: u64,
    pub last_error: Option<String>,
    pub last_error_at: Option<DateTime<Utc>>,
    pub last_reason: String,
    pub last_actor: String,
    pub updated_at: DateTime<Utc>,
    pub version: i64,
}

/// One entry of a dependency's history.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryEntry {
    pub id: i64,
    pub from_state: Option<String>,
    pub to_state: String,
    pub forced_open: bool,
    pub reason: String,
    pub actor: String,
    pub at: DateTime<Utc>,
}

fn view(r: &sqlx::postgres::PgRow) -> Result<DependencyView, sqlx::Error> {
    let c: Circuit = store::circuit(r)?;
    Ok(DependencyView {
        name: r.try_get("name")?,
        state: c.state,
        forced_open: c.forced_open,
        down_since: c.down_since,
        probe_at: c.probe_at,
        consecutive: c.consecutive,
        cooldown_ms: c.cooldown.as_millis() as u64,
        last_error: c.last_error,
        last_error_at: r.try_get("last_error_at")?,
        last_reason: c.reason,
        last_actor: r.try_get("last_actor")?,
        updated_at: r.try_get("updated_at")?,
        version: c.version,
    })
}

/// The circuit's columns (read by `store::circuit`) and what an operator sees besides.
fn select() -> String {
    format!(
        "SELECT name, {}, last_error_at, last_actor, updated_at FROM {{{{schema}}}}.dependencies",
        store::COLUMNS
    )
}

/// Every dependency, those that are not closed first.
pub async fn list(pool: &PgPool, schema: &Schema) -> Result<Vec<DependencyView>, sqlx::Error> {
    let sql = format!(
        "{} ORDER BY (state = 'closed' AND NOT forced_open), name",
        select()
    );
    let rows = sqlx::query(schema.sql(&sql)).fetch_all(pool).await?;
    rows.iter().map(view).collect()
}

/// One dependency (on a connection: an operator's action reads it in its own transaction).
pub async fn get(
    conn: &mut PgConnection,
    schema: &Schema,
    name: &str,
) -> Result<DependencyView, AdminError> {
    let sql = format!("{} WHERE name = $1", select());
    let row = sqlx::query(schema.sql(&sql))
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?;
    row.as_ref()
        .map(view)
        .transpose()?
        .ok_or_else(|| AdminError::NotFound(name.to_string()))
}

/// The latest `limit` entries of a dependency's history, newest first.
pub async fn history(
    pool: &PgPool,
    schema: &Schema,
    name: &str,
    limit: i64,
) -> Result<Vec<HistoryEntry>, sqlx::Error> {
    let rows = sqlx::query(schema.sql(
        "SELECT id, from_state, to_state, forced_open, reason, actor, at \
         FROM {{schema}}.dependency_history WHERE name = $1 ORDER BY id DESC LIMIT $2",
    ))
    .bind(name)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(HistoryEntry {
                id: r.try_get("id")?,
                from_state: r.try_get("from_state")?,
                to_state: r.try_get("to_state")?,
                forced_open: r.try_get("forced_open")?,
                reason: r.try_get("reason")?,
                actor: r.try_get("actor")?,
                at: r.try_get("at")?,
            })
        })
        .collect()
}

fn check(actor: &str, reason: &str) -> Result<(), AdminError> {
    if actor.trim().is_empty() || actor.len() > 200 || actor == "system" {
        return Err(AdminError::Invalid(
            "an operator action needs the operator's name (1-200 bytes, not \"system\")".into(),
        ));
    }
    if reason.trim().is_empty() || reason.len() > 1000 {
        return Err(AdminError::Invalid(
            "an operator action needs a reason (1-1000 bytes)".into(),
        ));
    }
    Ok(())
}

/// Holds the circuit open until an operator closes it: every call waits, nothing is spent. Runs
/// on `conn`, so an action's audit entry can commit with it.
pub async fn force_open(
    conn: &mut PgConnection,
    schema: &Schema,
    name: &str,
    actor: &str,
    reason: &str,
) -> Result<DependencyView, AdminError> {
    check(actor, reason)?;
    let set = "forced_open = true, down_since = coalesce(down_since, now())";
    by_hand(
        conn,
        schema,
        name,
        set,
        actor,
        &format!("opened by hand: {reason}"),
    )
    .await
}

/// Closes the circuit by hand (also one an operator held open): calls go again, and waiting work
/// resumes at the policy's rate. Runs on `conn`, as [`force_open`].
pub async fn close(
    conn: &mut PgConnection,
    schema: &Schema,
    name: &str,
    actor: &str,
    reason: &str,
) -> Result<DependencyView, AdminError> {
    let set = "state = 'closed', forced_open = false, consecutive = 0, window_started_at = NULL, \
         window_calls = 0, window_unavailable = 0, down_since = NULL, cooldown_ms = 0, \
         probe_at = NULL, probe_until = NULL";
    check(actor, reason)?;
    by_hand(
        conn,
        schema,
        name,
        set,
        actor,
        &format!("closed by hand: {reason}"),
    )
    .await
}

/// An operator's change `set` of `name`'s circuit, with the actor and the reason as recorded (both
/// checked by the caller), the version bumped (a worker's compare-and-set in flight then loses),
/// and the circuit after it.
async fn by_hand(
    conn: &mut PgConnection,
    schema: &Schema,
    name: &str,
    set: &str,
    actor: &str,
    reason: &str,
) -> Result<DependencyView, AdminError> {
    let sql = format!(
        "UPDATE {{{{schema}}}}.dependencies SET {set}, last_reason = $3, last_actor = $2, \
         version = version + 1, updated_at = now() WHERE name = $1"
    );
    let r = sqlx::query(schema.sql(&sql))
        .bind(name)
        .bind(actor)
        .bind(reason)
        .execute(&mut *conn)
        .await?;
    if r.rows_affected() == 0 {
        return Err(AdminError::NotFound(name.to_string()));
    }
    get(conn, schema, name).await
}
