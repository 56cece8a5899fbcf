//! Waking processes that wait for an external event, in the caller's transaction.
//!
//! [`signal`] stores the event under its correlation key in `process_events` and makes every
//! process waiting for that key due now, both in the caller's transaction: a webhook handler
//! calls it in the transaction of its inbox row, so the event is stored, the process woken and the
//! inbox row written together, or (rolled back) none of them. A process that has not reached its
//! wait yet finds the event there when it does.
//!
//! Lost wake-ups: the signal and the worker that parks a process at a wait both take a
//! transaction-scoped advisory lock on the key before they look. So either the worker's park
//! committed first (the signal's wake-up, run after it, sees the waiting step) or the signal
//! committed first (the worker, looking after it, finds the event and does not park).

use serde_json::Value;
use shared::schema::Schema;
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::start::notify_channel;

/// What a signal did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signalled {
    /// false: an event for this key was already stored (a wait takes the first; this one changed
    /// nothing).
    pub stored: bool,
    /// The waiting processes made due now (none if no process waits for the key yet).
    pub woken: Vec<Uuid>,
}

/// The advisory lock of a correlation key (shared with the worker's park, see the module docs).
pub(crate) const KEY_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('process_events:' || $1, 0))";

const STORE: &str = "INSERT INTO {{schema}}.process_events (key, payload, source) VALUES ($1, $2, $3) \
                     ON CONFLICT (key) DO NOTHING";

const WAKE: &str = "\
WITH woken AS (
    UPDATE {{schema}}.processes p SET next_run_at = now(), updated_at = now()
    FROM {{schema}}.process_steps s
    WHERE s.wait_key = $1 AND s.status IN ('running', 'retryable') AND s.process_id = p.id
      AND p.status = 'waiting'
    RETURNING p.id
)
SELECT id, (SELECT pg_notify($2, '') FROM woken LIMIT 1) AS notified FROM woken";

/// Stores the event `payload` for `key` (from `source`, e.g. `webhook:<event id>`) and wakes the
/// processes waiting for it, in `conn`'s transaction (which should be the one that records the
/// event's receipt; the worker sees nothing until it commits). The first event for a key wins.
pub async fn signal(
    conn: &mut PgConnection,
    schema: &Schema,
    key: &str,
    payload: &Value,
    source: &str,
) -> Result<Signalled, sqlx::Error> {
    sqlx::query(KEY_LOCK).bind(key).execute(&mut *conn).await?;
    let stored = sqlx::query(schema.sql(STORE))
        .bind(key)
        .bind(sqlx::types::Json(payload))
        .bind(crate::redact::truncate(source, 500))
        .execute(&mut *conn)
        .await?
        .rows_affected()
        == 1;
    let rows = sqlx::query(schema.sql(WAKE))
        .bind(key)
        .bind(notify_channel(schema))
        .fetch_all(&mut *conn)
        .await?;
    let woken = rows
        .iter()
        .map(|r| r.try_get("id"))
        .collect::<Result<Vec<Uuid>, _>>()?;
    Ok(Signalled { stored, woken })
}
