//! Producer inserts: what per-aggregate sequence numbers cost a producer's transaction.

use crate::env::BenchEnv;
use crate::report::Line;
use crate::scenarios::{median, payload};
use rand::{Rng, SeedableRng};
use shared::NewMessage;
use std::time::{Duration, Instant};

/// Producer inserts with sequence numbers against the same inserts into a table without them, in
/// schemas of their own: single-row and 100-row transactions, each on aggregates new to the outbox
/// (every row takes a new counter row), on different aggregates that already have their counters
/// (an order's, an account's later events), and on one aggregate. Two baselines: the layout at
/// migration 7 as it shipped (what the issue compares against), and migration 7 with migration
/// 20's header checks (the cheapest so far), so the cost of the numbers alone is visible too.
pub async fn producer_insert(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let shipped = shared::schema::Schema::new("bench_before_seq")?;
    let checks_only = shared::schema::Schema::new("bench_checks_only")?;
    for schema in [&shipped, &checks_only] {
        shared::migrate::migrator(schema)
            .run_to(7, &env.pool)
            .await?;
    }
    let checks = shared::migrate::sql_of(&checks_only, CHECKS_MIGRATION)
        .and_then(|sql| sql.split("\nDO $migration$").next().map(str::to_string))
        .ok_or_else(|| {
            anyhow::anyhow!("migration {CHECKS_MIGRATION} has no header checks to apply")
        })?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(checks))
        .execute(&env.pool)
        .await?;
    let after = shared::schema::Schema::default();
    // The known aggregates' counters exist before the measure (the migration 7 baselines have no
    // counters, so nothing to prepare there).
    let outbox = shared::outbox::Outbox::new(after.clone());
    let known: Vec<NewMessage> = (0..KNOWN_AGGREGATES)
        .map(|k| NewMessage::new("bench", InsertKeys::known(k), "bench.insert", payload(k)))
        .collect();
    for chunk in known.chunks(1000) {
        outbox.enqueue_many(&env.pool, chunk).await?;
    }
    sqlx::query(after.sql("TRUNCATE {{schema}}.messages"))
        .execute(&env.pool)
        .await?;
    let duration = env.secs(5.0, 1.0);
    let mut lines = Vec::new();
    for rows in [1usize, 100] {
        for keys in [InsertKeys::New, InsertKeys::Known, InsertKeys::One] {
            let mut rates = [Vec::new(), Vec::new(), Vec::new()];
            // Rounds in turn, so drift on a shared machine hits all alike.
            for _ in 0..2 {
                for (i, schema) in [&shipped, &checks_only, &after].into_iter().enumerate() {
                    rates[i].push(insert_rate(env, schema, rows, keys, duration / 3).await?);
                }
            }
            let [shipped_rate, checks_rate, with] = rates.map(median);
            let what = format!("producer-insert ({rows}-row transactions, {})", keys.name());
            lines.push(
                Line::new(&what, with, "rows/s")
                    .vs_ceiling(shipped_rate, Some(0.85))
                    .note(format!(
                        "1 connection; ceiling = the same inserts without sequence numbers (schema at migration 7 as shipped): {shipped_rate:.0} rows/s; numbers alone (migration 7 with migration {CHECKS_MIGRATION}'s header checks: {checks_rate:.0} rows/s): {:.0} %",
                        with * 100.0 / checks_rate.max(1.0)
                    )),
            );
        }
    }
    for schema in [&shipped, &checks_only] {
        sqlx::query(schema.sql("DROP SCHEMA {{schema}} CASCADE"))
            .execute(&env.pool)
            .await?;
    }
    Ok(lines)
}

/// The migration whose header check functions (the SQL before its first `DO` block) the
/// "numbers alone" baseline gets: the latest that changed them.
const CHECKS_MIGRATION: i64 = 20;

/// How many aggregates have their counters before [`producer_insert`] measures [`InsertKeys::Known`].
const KNOWN_AGGREGATES: u64 = 10_000;

/// Which aggregates a producer-insert measure writes.
#[derive(Debug, Clone, Copy)]
enum InsertKeys {
    /// Drawn from 10 million: nearly every row is its aggregate's first (a new counter row).
    New,
    /// Drawn from the [`KNOWN_AGGREGATES`] whose counters exist: each row moves a counter on.
    Known,
    /// Every row on one aggregate.
    One,
}

impl InsertKeys {
    fn name(self) -> &'static str {
        match self {
            InsertKeys::New => "new aggregates",
            InsertKeys::Known => "different aggregates that have counters",
            InsertKeys::One => "one aggregate",
        }
    }

    fn known(k: u64) -> String {
        format!("known-{k}")
    }

    fn draw(self, rng: &mut rand::rngs::StdRng) -> String {
        match self {
            InsertKeys::New => format!("agg-{}", rng.random_range(0..10_000_000u64)),
            InsertKeys::Known => InsertKeys::known(rng.random_range(0..KNOWN_AGGREGATES)),
            InsertKeys::One => "hot".to_string(),
        }
    }
}

async fn insert_rate(
    env: &BenchEnv,
    schema: &shared::schema::Schema,
    rows: usize,
    keys: InsertKeys,
    duration: Duration,
) -> anyhow::Result<f64> {
    let outbox = shared::outbox::Outbox::new(schema.clone());
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let started = Instant::now();
    let mut done = 0u64;
    while started.elapsed() < duration {
        let batch: Vec<NewMessage> = (0..rows)
            .map(|_| NewMessage::new("bench", keys.draw(&mut rng), "bench.insert", payload(done)))
            .collect();
        let mut tx = env.pool.begin().await?;
        outbox.enqueue_many(&mut *tx, &batch).await?;
        tx.commit().await?;
        done += rows as u64;
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    sqlx::query(schema.sql("TRUNCATE {{schema}}.messages"))
        .execute(&env.pool)
        .await?;
    Ok(rate)
}
