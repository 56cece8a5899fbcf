//! `relay verify`: after an incident, did every message committed in a time window reach a
//! consumer? Reconciles the outbox's published rows (kept when `--retention-secs` is on) against
//! the consumer's `processed_messages` rows, or, for an ordered consumer (which writes none), its
//! aggregates' positions in `consumer_positions`: a message its aggregate's position has reached
//! is processed (it has no processing time, so it stays out of the lag).
//!
//! Reported: the rows of the window by state (published, pending, dead); the published ones the
//! consumer has no record of (**missing**; rows published in the last `settle` are counted apart,
//! as still in flight); the end-to-end lag `processed_at - created_at` (p50, p99, max) of the
//! processed ones; processed rows whose message is not in the outbox (purged by retention or from
//! another producer). Applying a message twice leaves no trace in `processed_messages` (one row
//! per consumer and message id: a second application fails its transaction), so duplicates can
//! only be seen in the consumer's own effects; the report says so rather than guess.

use shared::display::escape_control as esc;
use shared::schema::Schema;
use sqlx::PgPool;
use std::io::Write;
use std::time::Duration;

/// What to reconcile.
#[derive(Debug, Clone)]
pub struct VerifyRequest {
    /// The consumer's name (the `consumer` column of `processed_messages`).
    pub consumer: String,
    /// Window on the rows' `created_at`: `[since, until)`.
    pub since: chrono::DateTime<chrono::Utc>,
    pub until: chrono::DateTime<chrono::Utc>,
    /// Only these event types (the ones the consumer is bound to); empty: all.
    pub event_types: Vec<String>,
    /// Rows published this recently are in flight, not missing.
    pub settle: Duration,
    /// Most missing ids listed (all are counted).
    pub list_limit: i64,
}

/// A missing message: published, no record at the consumer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Missing {
    pub id: uuid::Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub published_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// End-to-end lag of the processed messages, in seconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Lag {
    pub p50_seconds: Option<f64>,
    pub p99_seconds: Option<f64>,
    pub max_seconds: Option<f64>,
}

/// The reconciliation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct VerifyReport {
    pub consumer: String,
    pub since: chrono::DateTime<chrono::Utc>,
    pub until: chrono::DateTime<chrono::Utc>,
    pub event_types: Vec<String>,
    pub published: i64,
    pub pending: i64,
    pub dead: i64,
    pub processed: i64,
    pub missing: i64,
    /// Published within the settle time and not processed yet.
    pub in_flight: i64,
    pub missing_ids: Vec<Missing>,
    /// Processed rows of the window whose message is not in the outbox.
    pub processed_unknown: i64,
    /// Always 0: see [`DUPLICATES_NOTE`].
    pub duplicates_applied: i64,
    pub duplicates_note: &'static str,
    pub lag: Lag,
}

/// Why `duplicates_applied` is 0 by construction.
pub const DUPLICATES_NOTE: &str = "processed_messages holds one row per (consumer, message id), written in the transaction that applies the message: a second application fails and rolls back; check the consumer's own effects for anything applied outside that transaction";

impl VerifyReport {
    /// Something committed and published never reached the consumer.
    pub fn ok(&self) -> bool {
        self.missing == 0
    }
}

const FILTER: &str = "m.created_at >= $1 AND m.created_at < $2 \
     AND (cardinality($3::text[]) = 0 OR m.event_type = ANY($3))";

/// Message `m` reached consumer `$4`: a `processed_messages` row (an unordered consumer's), or an
/// ordered consumer's position at or past its `aggregate_seq` (ordered mode writes no
/// `processed_messages` rows; its position moves past a message only once it was applied, or
/// dead-lettered by an operator's skip).
const RECORDED: &str = "(EXISTS (SELECT 1 FROM {{schema}}.processed_messages p \
                 WHERE p.consumer = $4 AND p.message_id = m.id) \
     OR EXISTS (SELECT 1 FROM {{schema}}.consumer_positions c \
                 WHERE c.consumer = $4 AND c.aggregate_type = m.aggregate_type \
                   AND c.aggregate_id = m.aggregate_id AND c.applied_seq >= m.aggregate_seq))";

/// Runs the reconciliation (read-only; a handful of statements over the window).
pub async fn verify(
    pool: &PgPool,
    schema: &Schema,
    req: &VerifyRequest,
) -> Result<VerifyReport, sqlx::Error> {
    let settle_before = chrono::Utc::now()
        - chrono::Duration::from_std(req.settle).unwrap_or(chrono::Duration::zero());
    let counts: (i64, i64, i64) = sqlx::query_as(schema.sql(&format!(
        "SELECT count(*) FILTER (WHERE m.state = 'published'), \
                count(*) FILTER (WHERE m.state = 'pending'), \
                count(*) FILTER (WHERE m.state = 'dead') \
         FROM {{{{schema}}}}.messages m WHERE {FILTER}"
    )))
    .bind(req.since)
    .bind(req.until)
    .bind(&req.event_types)
    .fetch_one(pool)
    .await?;
    let unprocessed = format!(
        "FROM {{{{schema}}}}.messages m WHERE {FILTER} AND m.state = 'published' \
         AND NOT {RECORDED}"
    );
    let (missing, in_flight): (i64, i64) = sqlx::query_as(schema.sql(&format!(
        "SELECT count(*) FILTER (WHERE m.published_at IS NULL OR m.published_at < $5), \
                count(*) FILTER (WHERE m.published_at >= $5) {unprocessed}"
    )))
    .bind(req.since)
    .bind(req.until)
    .bind(&req.event_types)
    .bind(&req.consumer)
    .bind(settle_before)
    .fetch_one(pool)
    .await?;
    let missing_ids = missing_ids(pool, schema, req, settle_before, &unprocessed).await?;
    let (processed, lag) = processed_and_lag(pool, schema, req).await?;
    let processed_unknown: i64 = sqlx::query_scalar(schema.sql(
        "SELECT count(*) FROM {{schema}}.processed_messages p \
         WHERE p.consumer = $1 AND p.processed_at >= $2 AND p.processed_at < $3 \
           AND NOT EXISTS (SELECT 1 FROM {{schema}}.messages m WHERE m.id = p.message_id)",
    ))
    .bind(&req.consumer)
    .bind(req.since)
    .bind(req.until)
    .fetch_one(pool)
    .await?;
    Ok(VerifyReport {
        consumer: req.consumer.clone(),
        since: req.since,
        until: req.until,
        event_types: req.event_types.clone(),
        published: counts.0,
        pending: counts.1,
        dead: counts.2,
        processed,
        missing,
        in_flight,
        missing_ids,
        processed_unknown,
        duplicates_applied: 0,
        duplicates_note: DUPLICATES_NOTE,
        lag,
    })
}

/// The messages of the window published before `settle_before` that never reached the consumer
/// (`unprocessed`: the FROM and WHERE that find them), oldest first, at most `list_limit`.
async fn missing_ids(
    pool: &PgPool,
    schema: &Schema,
    req: &VerifyRequest,
    settle_before: chrono::DateTime<chrono::Utc>,
    unprocessed: &str,
) -> Result<Vec<Missing>, sqlx::Error> {
    type Row = (
        uuid::Uuid,
        String,
        String,
        String,
        chrono::DateTime<chrono::Utc>,
        Option<chrono::DateTime<chrono::Utc>>,
    );
    let rows: Vec<Row> = sqlx::query_as(schema.sql(&format!(
        "SELECT m.id, m.event_type, m.aggregate_type, m.aggregate_id, m.created_at, m.published_at \
         {unprocessed} AND (m.published_at IS NULL OR m.published_at < $5) ORDER BY m.seq LIMIT $6"
    )))
    .bind(req.since)
    .bind(req.until)
    .bind(&req.event_types)
    .bind(&req.consumer)
    .bind(settle_before)
    .bind(req.list_limit)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(id, event_type, aggregate_type, aggregate_id, created_at, published_at)| Missing {
                id,
                event_type,
                aggregate_type,
                aggregate_id,
                created_at,
                published_at,
            },
        )
        .collect())
}

/// How many messages of the window reached the consumer, and their lag from commit to processing.
async fn processed_and_lag(
    pool: &PgPool,
    schema: &Schema,
    req: &VerifyRequest,
) -> Result<(i64, Lag), sqlx::Error> {
    let (processed, p50, p99, max): (i64, Option<f64>, Option<f64>, Option<f64>) =
        sqlx::query_as(schema.sql(&format!(
            // The lag needs a processing time: an ordered consumer's messages count, without one.
            "WITH lag AS (SELECT (SELECT extract(epoch FROM p.processed_at - m.created_at)::float8 \
                 FROM {{{{schema}}}}.processed_messages p \
                 WHERE p.consumer = $4 AND p.message_id = m.id) AS s \
               FROM {{{{schema}}}}.messages m WHERE {FILTER} AND {RECORDED}) \
             SELECT count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY s), \
                    percentile_cont(0.99) WITHIN GROUP (ORDER BY s), max(s) FROM lag"
        )))
        .bind(req.since)
        .bind(req.until)
        .bind(&req.event_types)
        .bind(&req.consumer)
        .fetch_one(pool)
        .await?;
    let lag = Lag {
        p50_seconds: p50,
        p99_seconds: p99,
        max_seconds: max,
    };
    Ok((processed, lag))
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |s| format!("{s:.3}s"))
}

/// The report for people. Every value from a row is escaped.
pub fn write_human(r: &VerifyReport, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "consumer {}: messages created {} .. {}{}",
        esc(&r.consumer),
        r.since.to_rfc3339(),
        r.until.to_rfc3339(),
        if r.event_types.is_empty() {
            String::new()
        } else {
            format!(
                " (event types {})",
                r.event_types
                    .iter()
                    .map(|t| esc(t).into_owned())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    )?;
    writeln!(
        out,
        "  outbox: {} published, {} pending, {} dead",
        r.published, r.pending, r.dead
    )?;
    writeln!(
        out,
        "  consumer: {} processed, {} missing, {} in flight (published within the settle time), {} processed but not in the outbox",
        r.processed, r.missing, r.in_flight, r.processed_unknown
    )?;
    writeln!(
        out,
        "  end-to-end lag (processed_at - created_at): p50 {}, p99 {}, max {}",
        secs(r.lag.p50_seconds),
        secs(r.lag.p99_seconds),
        secs(r.lag.max_seconds)
    )?;
    writeln!(
        out,
        "  duplicates applied: {} ({})",
        r.duplicates_applied, r.duplicates_note
    )?;
    if !r.missing_ids.is_empty() {
        writeln!(
            out,
            "  missing ({} listed of {}):",
            r.missing_ids.len(),
            r.missing
        )?;
        for m in &r.missing_ids {
            writeln!(
                out,
                "    {}  {}  {}/{}  created {}",
                m.id,
                esc(&m.event_type),
                esc(&m.aggregate_type),
                esc(&m.aggregate_id),
                m.created_at.to_rfc3339()
            )?;
        }
    }
    writeln!(
        out,
        "{}",
        if r.ok() {
            "OK: nothing missing"
        } else {
            "MISSING: published messages the consumer has no record of"
        }
    )
}

/// The report as Prometheus text (for node_exporter's textfile collector, after a cron run).
pub fn write_prometheus(r: &VerifyReport, out: &mut impl Write) -> std::io::Result<()> {
    // Label values escaped the Prometheus way (backslash, quote, newline).
    let c = r
        .consumer
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    writeln!(
        out,
        "# HELP outbox_verify_missing_messages Published outbox messages the consumer has no record of"
    )?;
    writeln!(out, "# TYPE outbox_verify_missing_messages gauge")?;
    writeln!(
        out,
        "outbox_verify_missing_messages{{consumer=\"{c}\"}} {}",
        r.missing
    )?;
    writeln!(out, "# TYPE outbox_verify_processed_messages gauge")?;
    writeln!(
        out,
        "outbox_verify_processed_messages{{consumer=\"{c}\"}} {}",
        r.processed
    )?;
    writeln!(
        out,
        "# HELP outbox_verify_lag_seconds End-to-end lag, processed_at - created_at, over the window"
    )?;
    writeln!(out, "# TYPE outbox_verify_lag_seconds gauge")?;
    for (q, v) in [
        ("0.5", r.lag.p50_seconds),
        ("0.99", r.lag.p99_seconds),
        ("1", r.lag.max_seconds),
    ] {
        if let Some(v) = v {
            writeln!(
                out,
                "outbox_verify_lag_seconds{{consumer=\"{c}\",quantile=\"{q}\"}} {v}"
            )?;
        }
    }
    Ok(())
}

/// Errors in `--since` / `--until` / `--settle`.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is neither an RFC 3339 time nor a duration like 90s, 15m, 2h, 1d")]
pub struct BadTime(pub String);

/// A duration like `90s`, `15m`, `2h`, `1d`, `500ms` or `1h 30m` (humantime's forms), or a bare
/// number of seconds (`3600`).
pub fn parse_duration(s: &str) -> Result<Duration, BadTime> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s).map_err(|_| BadTime(s.to_string()))
}

/// An RFC 3339 time, or a duration meaning that long before `now`.
pub fn parse_time(
    s: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<chrono::DateTime<chrono::Utc>, BadTime> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s.trim()) {
        return Ok(t.with_timezone(&chrono::Utc));
    }
    let d = parse_duration(s)?;
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .ok_or_else(|| BadTime(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_durations_parse() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("1d").unwrap(), Duration::from_secs(86_400));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("3600").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("1 fortnight").is_err());
        assert!(parse_duration("m").is_err());
        let now = chrono::Utc::now();
        assert_eq!(
            parse_time("1h", now).unwrap(),
            now - chrono::Duration::hours(1)
        );
        assert_eq!(
            parse_time("2026-12-01T10:00:00Z", now)
                .unwrap()
                .to_rfc3339(),
            "2026-12-01T10:00:00+00:00"
        );
        assert!(parse_time("yesterday", now).is_err());
    }
}
