//! The statements on `dependencies` and `dependency_slots`: the circuit read and written
//! compared-and-set on its version, the rate limiter's bucket and the concurrency slots taken
//! atomically, each in one statement.

use crate::circuit::Circuit;
use crate::state::CircuitState;
use shared::display::truncate;
use shared::schema::Schema;
use sqlx::postgres::PgRow;
use sqlx::{PgExecutor, Row};
use std::time::Duration;
use uuid::Uuid;

/// Creates the dependency's row (closed, a full bucket) if it is not there yet.
pub async fn ensure<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
    burst: Option<u32>,
) -> Result<(), sqlx::Error> {
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.dependencies (name, tokens, tokens_at) \
         VALUES ($1, $2, CASE WHEN $2 IS NOT NULL THEN now() END) ON CONFLICT (name) DO NOTHING",
    ))
    .bind(name)
    .bind(burst.map(f64::from))
    .execute(db)
    .await?;
    Ok(())
}

/// Makes `cap` slots exist (0..cap); free slots past it are removed.
pub async fn ensure_slots<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
    cap: u32,
) -> Result<(), sqlx::Error> {
    sqlx::query(schema.sql(
        "WITH added AS ( \
             INSERT INTO {{schema}}.dependency_slots (name, slot) \
             SELECT $1, g FROM generate_series(0, $2 - 1) g ON CONFLICT DO NOTHING) \
         DELETE FROM {{schema}}.dependency_slots WHERE name = $1 AND slot >= $2 AND holder IS NULL",
    ))
    .bind(name)
    .bind(cap as i32)
    .execute(db)
    .await?;
    Ok(())
}

/// The circuit's columns, as [`circuit`] reads them.
pub const COLUMNS: &str = "state, forced_open, consecutive, window_started_at, window_calls, \
    window_unavailable, down_since, cooldown_ms, probe_at, probe_until, last_error, last_reason, version";

/// The circuit from a row of [`COLUMNS`].
pub fn circuit(r: &PgRow) -> Result<Circuit, sqlx::Error> {
    let state: String = r.try_get("state")?;
    let cooldown_ms: i64 = r.try_get("cooldown_ms")?;
    Ok(Circuit {
        state: CircuitState::parse(&state)
            .ok_or_else(|| sqlx::Error::Protocol(format!("unknown circuit state {state:?}")))?,
        forced_open: r.try_get("forced_open")?,
        consecutive: r.try_get("consecutive")?,
        window_started_at: r.try_get("window_started_at")?,
        window_calls: r.try_get("window_calls")?,
        window_unavailable: r.try_get("window_unavailable")?,
        down_since: r.try_get("down_since")?,
        cooldown: Duration::from_millis(cooldown_ms.max(0) as u64),
        probe_at: r.try_get("probe_at")?,
        probe_until: r.try_get("probe_until")?,
        last_error: r.try_get("last_error")?,
        reason: r.try_get("last_reason")?,
        version: r.try_get("version")?,
    })
}

/// The circuit as stored now.
pub async fn load<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
) -> Result<Option<Circuit>, sqlx::Error> {
    let sql = format!("SELECT {COLUMNS} FROM {{{{schema}}}}.dependencies WHERE name = $1");
    let row = sqlx::query(schema.sql(&sql))
        .bind(name)
        .fetch_optional(db)
        .await?;
    row.as_ref().map(circuit).transpose()
}

/// Writes `next` if the row still has `next.version` (the version it was read at); true if it
/// did. The version then grows by one.
pub async fn compare_and_set<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
    next: &Circuit,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(schema.sql(
        "UPDATE {{schema}}.dependencies SET \
             state = $3, consecutive = $4, window_started_at = $5, window_calls = $6, \
             window_unavailable = $7, down_since = $8, cooldown_ms = $9, probe_at = $10, \
             probe_until = $11, last_error = $12, \
             last_error_at = CASE WHEN $12 IS DISTINCT FROM last_error THEN now() ELSE last_error_at END, \
             last_reason = $13, last_actor = 'system', version = version + 1, updated_at = now() \
         WHERE name = $1 AND version = $2",
    ))
    .bind(name)
    .bind(next.version)
    .bind(next.state.as_str())
    .bind(next.consecutive)
    .bind(next.window_started_at)
    .bind(next.window_calls)
    .bind(next.window_unavailable)
    .bind(next.down_since)
    .bind(next.cooldown.as_millis().min(i64::MAX as u128) as i64)
    .bind(next.probe_at)
    .bind(next.probe_until)
    .bind(next.last_error.as_deref().map(|e| truncate(e, 500)))
    .bind(truncate(&next.reason, 1000))
    .execute(db)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Takes one token from the bucket (`per_second`, `burst`): `Ok(tokens left)`, or `Err(wait)`
/// until one is there.
pub async fn take_token<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
    per_second: f64,
    burst: u32,
) -> Result<Result<f64, Duration>, sqlx::Error> {
    let row = sqlx::query(schema.sql(
        "WITH cur AS ( \
             SELECT name, least($3::float8, coalesce(tokens, $3::float8) + $2::float8 * \
                 extract(epoch FROM clock_timestamp() - coalesce(tokens_at, clock_timestamp()))::float8) AS t \
             FROM {{schema}}.dependencies WHERE name = $1 FOR UPDATE), \
         took AS ( \
             UPDATE {{schema}}.dependencies d SET tokens = cur.t - 1, tokens_at = clock_timestamp() \
             FROM cur WHERE d.name = cur.name AND cur.t >= 1 RETURNING d.name) \
         SELECT cur.t, EXISTS (SELECT 1 FROM took) AS took FROM cur",
    ))
    .bind(name)
    .bind(per_second)
    .bind(f64::from(burst))
    .fetch_optional(db)
    .await?;
    let Some(row) = row else {
        return Ok(Err(Duration::from_millis(100)));
    };
    let t: f64 = row.try_get("t")?;
    let took: bool = row.try_get("took")?;
    if took {
        Ok(Ok(t - 1.0))
    } else {
        let wait = ((1.0 - t).max(0.0) / per_second).clamp(0.001, 3600.0);
        Ok(Err(Duration::from_secs_f64(wait)))
    }
}

/// A dependency's limits now: its concurrency slots held (not expired), and the tokens in its
/// bucket as refilled to now (`per_second`, `burst`; `None` without a rate limit).
pub async fn usage<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
    rate: Option<(f64, u32)>,
) -> Result<(i64, Option<f64>), sqlx::Error> {
    let row = sqlx::query(schema.sql(
        "SELECT (SELECT count(*) FROM {{schema}}.dependency_slots                  WHERE name = $1 AND holder IS NOT NULL AND held_until >= clock_timestamp()) AS held,                 (SELECT least($3::float8, coalesce(tokens, $3::float8) + $2::float8 *                      extract(epoch FROM clock_timestamp() - coalesce(tokens_at, clock_timestamp()))::float8)                  FROM {{schema}}.dependencies WHERE name = $1) AS tokens",
    ))
    .bind(name)
    .bind(rate.map_or(0.0, |r| r.0))
    .bind(rate.map_or(0.0, |r| f64::from(r.1)))
    .fetch_one(db)
    .await?;
    let held: i64 = row.try_get("held")?;
    let tokens: Option<f64> = row.try_get("tokens")?;
    Ok((held, rate.and(tokens)))
}

/// Takes a free (or expired) concurrency slot for `holder` until `held_for` passes.
pub async fn take_slot<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
    holder: Uuid,
    held_for: Duration,
) -> Result<Option<i32>, sqlx::Error> {
    let row = sqlx::query(schema.sql(
        "UPDATE {{schema}}.dependency_slots s \
         SET holder = $2, held_until = clock_timestamp() + $3 * interval '1 millisecond' \
         WHERE (s.name, s.slot) = ( \
             SELECT name, slot FROM {{schema}}.dependency_slots \
             WHERE name = $1 AND (holder IS NULL OR held_until < clock_timestamp()) \
             ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED) \
         RETURNING s.slot",
    ))
    .bind(name)
    .bind(holder)
    .bind(held_for.as_millis().min(i32::MAX as u128) as f64)
    .fetch_optional(db)
    .await?;
    row.map(|r| r.try_get("slot")).transpose()
}

/// Gives slot `slot` back (if `holder` still has it).
pub async fn release_slot<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
    slot: i32,
    holder: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.dependency_slots SET holder = NULL, held_until = NULL \
         WHERE name = $1 AND slot = $2 AND holder = $3",
    ))
    .bind(name)
    .bind(slot)
    .bind(holder)
    .execute(db)
    .await?;
    Ok(())
}

/// Takes the dependency's wake-up turn: true for at most one caller a second across all
/// instances (so waiting work resumes at the policy's rate, not at that rate per instance).
pub async fn take_resume_turn<'e>(
    db: impl PgExecutor<'e>,
    schema: &Schema,
    name: &str,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(schema.sql(
        "UPDATE {{schema}}.dependencies SET resumed_at = clock_timestamp() \
         WHERE name = $1 AND (resumed_at IS NULL OR resumed_at <= clock_timestamp() - interval '1 second')",
    ))
    .bind(name)
    .execute(db)
    .await?;
    Ok(r.rows_affected() == 1)
}
