//! The overview's history: a sampler task records, every interval (a minute by default), the
//! figures the overview charts over the last hour, in the console's own `console_samples` table.
//! Each figure comes from the crate that owns it (the relay's backlog, the processes crate's
//! review backlog, the consumer crate's dead-letter depth); rows older than two days are pruned
//! by the sampler itself, so the table stays small without a job of its own.

use crate::error::ConsoleError;
use crate::state::AppState;
use chrono::{DateTime, Utc};
use shared::schema::Schema;
use sqlx::PgPool;
use std::collections::HashMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Pending outbox rows.
pub const OUTBOX_PENDING: &str = "outbox_pending";
/// Age of the oldest pending outbox row, in seconds.
pub const OUTBOX_OLDEST: &str = "outbox_oldest_seconds";
/// Dead outbox rows.
pub const OUTBOX_DEAD: &str = "outbox_dead";
/// Processes in manual review.
pub const MANUAL_REVIEW: &str = "manual_review";
/// Dead letters of every configured consumer together.
pub const DEAD_LETTERS: &str = "dead_letters";

/// The series of one consumer's dead letters.
pub fn dead_letters_of(consumer: &str) -> String {
    format!("{DEAD_LETTERS}:{consumer}")
}

/// How long samples are kept.
const KEEP: &str = "2 days";
/// A dead-letter queue that does not answer within this is left out of the sample.
const DLQ_TIMEOUT: Duration = Duration::from_secs(5);

/// Starts the sampler: one sample at once, then one every `look.sample_interval`, until
/// `shutdown` ([`plumbing::periodic::every`], so a slow sample spaces the next out). A failed
/// sample is logged and the next one tried; it never stops the console.
pub fn spawn(state: AppState, shutdown: CancellationToken) {
    let every = state.settings.look.sample_interval();
    tokio::spawn(async move {
        plumbing::periodic::every(every, &shutdown, Sampler(state)).await;
    });
}

/// One sample per refresh.
struct Sampler(AppState);

impl plumbing::periodic::Refresh for Sampler {
    async fn refresh(&mut self) {
        if let Err(e) = sample(&self.0).await {
            tracing::warn!(error = %e, "console sample failed");
        }
    }
}

/// Measures every figure now and records them (and prunes old samples).
pub async fn sample(s: &AppState) -> Result<(), ConsoleError> {
    let backlog = relay::store::backlog(&s.pool, &s.schema).await?;
    let review = processes::look::review_backlog(&s.pool, &s.schema).await?;
    let mut figures: Vec<(String, f64)> = vec![
        (OUTBOX_PENDING.into(), backlog.pending as f64),
        (OUTBOX_OLDEST.into(), backlog.oldest_age.as_secs_f64()),
        (OUTBOX_DEAD.into(), backlog.dead as f64),
        (MANUAL_REVIEW.into(), review.count as f64),
    ];
    let mut total = 0.0;
    for (consumer, depth) in dlq_depths(s).await {
        if let Some(d) = depth {
            total += d as f64;
            figures.push((dead_letters_of(&consumer), d as f64));
        }
    }
    if !s.settings.consumers.is_empty() {
        figures.push((DEAD_LETTERS.into(), total));
    }
    record(&s.pool, &s.schema, &figures).await
}

/// The dead-letter depth of each configured consumer (`None`: its queue did not answer).
pub async fn dlq_depths(s: &AppState) -> Vec<(String, Option<usize>)> {
    // All at once: with the broker unreachable the page waits one timeout, not one per consumer.
    futures::future::join_all(s.settings.consumers.iter().map(|c| async move {
        let depth = tokio::time::timeout(
            DLQ_TIMEOUT,
            consumer::dlq::depth(&s.settings.amqp_url, &s.settings.amqp_tls, c),
        )
        .await;
        (c.clone(), depth.ok().and_then(Result::ok))
    }))
    .await
}

async fn record(
    pool: &PgPool,
    schema: &Schema,
    figures: &[(String, f64)],
) -> Result<(), ConsoleError> {
    let names: Vec<&str> = figures.iter().map(|(n, _)| n.as_str()).collect();
    let values: Vec<f64> = figures.iter().map(|(_, v)| *v).collect();
    let mut tx = pool.begin().await?;
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.console_samples (at, series, value) \
         SELECT clock_timestamp(), s, v FROM unnest($1::text[], $2::float8[]) AS t(s, v) \
         ON CONFLICT DO NOTHING",
    ))
    .bind(&names)
    .bind(&values)
    .execute(&mut *tx)
    .await?;
    sqlx::query(schema.sql(&format!(
        "DELETE FROM {{{{schema}}}}.console_samples WHERE at < now() - interval '{KEEP}'"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// One series over time, oldest first.
pub type Series = Vec<(DateTime<Utc>, f64)>;

/// The samples of `series` taken since `since`, by series name.
pub async fn since(
    pool: &PgPool,
    schema: &Schema,
    series: &[String],
    since: DateTime<Utc>,
) -> Result<HashMap<String, Series>, ConsoleError> {
    let rows: Vec<(String, DateTime<Utc>, f64)> = sqlx::query_as(schema.sql(
        "SELECT series, at, value FROM {{schema}}.console_samples \
         WHERE series = ANY($1) AND at >= $2 ORDER BY at",
    ))
    .bind(series)
    .bind(since)
    .fetch_all(pool)
    .await?;
    let mut out: HashMap<String, Series> = HashMap::new();
    for (name, at, value) in rows {
        out.entry(name).or_default().push((at, value));
    }
    Ok(out)
}
