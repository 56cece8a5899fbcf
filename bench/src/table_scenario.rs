//! Memory over a long drain, and the claim rate with ten million retained and dead rows.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::*;
use anyhow::Context;
use std::time::{Duration, Instant};

/// Peak RSS of one relay process draining a large backlog.
pub(crate) async fn soak_memory(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(1_000_000, 2000);
    env.reset_outbox().await?;
    let q = env.queue("soak", "bench.soak").await?;
    fill_outbox(env, n, 10_000, "bench.soak").await?;
    let relay = env.spawn_relay(&[])?;
    let pid = relay.id().context("relay pid")?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    let mut peak = 0u64;
    while pending(env).await? > 0 {
        if let Some((hwm, _)) = env::rss(pid) {
            peak = peak.max(hwm);
        }
        anyhow::ensure!(Instant::now() < deadline, "soak not drained in 600 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Some((hwm, _)) = env::rss(pid) {
        peak = peak.max(hwm);
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    env::stop(relay).await;
    env.delete_queue(&q).await;
    let mib = peak as f64 / (1024.0 * 1024.0);
    Ok(vec![
        Line::new("soak-memory (relay peak RSS)", mib, "MiB")
            .at_most(64.0)
            .note(format!(
                "{n} rows drained at {rate:.0} msg/s, VmHWM of the relay process"
            )),
    ])
}

/// The relay's own claim query, with and without a large table of retained and dead rows.
pub(crate) async fn table_growth(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let filler = env.n(10_000_000, 10_000);
    let n = env.n(200_000, 1000);
    // Each rate is the median of three runs: one run is short and moves with autovacuum. The
    // empty table is measured before and after the full one, and the full table is compared with
    // their mean, so a drift of the machine during the scenario does not count as table growth.
    let empty_before = median_claim_rate(env, n).await?;
    // Half published-and-retained, half dead, spread over all partitions; in chunks, on one
    // connection without the statement timeout the services use.
    let mut conn = env.pool.acquire().await?;
    sqlx::query("SET statement_timeout = 0")
        .execute(&mut *conn)
        .await?;
    let chunk = 1_000_000u64;
    let mut done = 0u64;
    while done < filler {
        let k = chunk.min(filler - done);
        sqlx::query(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, state, published_at, attempts, last_error) \
             SELECT 'bench', 'agg-' || (g % 100000), 'bench.old', '{\"old\": true}'::jsonb, \
                    CASE WHEN g % 2 = 0 THEN 'published' ELSE 'dead' END, \
                    CASE WHEN g % 2 = 0 THEN now() ELSE NULL END, \
                    CASE WHEN g % 2 = 0 THEN 0 ELSE 10 END, \
                    CASE WHEN g % 2 = 0 THEN NULL ELSE 'nacked by broker' END \
             FROM generate_series($1, $2) g",
        )
        .bind((done + 1) as i64)
        .bind((done + k) as i64)
        .execute(&mut *conn)
        .await?;
        done += k;
    }
    sqlx::query("VACUUM ANALYZE outbox.messages")
        .execute(&mut *conn)
        .await?;
    sqlx::query("RESET statement_timeout")
        .execute(&mut *conn)
        .await?;
    drop(conn);
    let full = median_claim_rate(env, n).await?;
    sqlx::query("TRUNCATE outbox.messages")
        .execute(&env.pool)
        .await?;
    let empty_after = median_claim_rate(env, n).await?;
    let empty = (empty_before + empty_after) / 2.0;
    let ratio = full / empty;
    let mut line = Line::new(
        &format!("table-growth (claim rate with {filler} retained/dead rows)"),
        full,
        "rows/s",
    )
    .vs_ceiling(empty, Some(0.9));
    line.target = Some("within 10% of empty table".into());
    line.met = Some(ratio >= 0.9);
    Ok(vec![
        Line::new("table-growth (claim rate, empty table)", empty, "rows/s").note(format!(
            "mean of the empty table before ({empty_before:.0} rows/s) and after ({empty_after:.0} rows/s) the full one"
        )),
        line.note(format!("relay::store::claim + delete of {n} rows, batch 1000, all 64 partitions owned; median of 3 runs each, each after VACUUM and CHECKPOINT")),
    ])
}

pub(crate) async fn median_claim_rate(env: &BenchEnv, n: u64) -> anyhow::Result<f64> {
    let mut rates = Vec::new();
    for _ in 0..3 {
        rates.push(claim_rate(env, n).await?);
    }
    Ok(crate::scenarios::median(rates))
}

pub(crate) async fn claim_rate(env: &BenchEnv, n: u64) -> anyhow::Result<f64> {
    sqlx::query("DELETE FROM outbox.messages WHERE state = 'pending'")
        .execute(&env.pool)
        .await?;
    sqlx::query("UPDATE outbox.relay_partitions SET owner = 'bench', lease_until = 'infinity', blocked_until = NULL, blocked_seq = NULL")
        .execute(&env.pool)
        .await?;
    fill_outbox(env, n, 1000, "bench.claim").await?;
    // Same table state for both measurements: vacuumed and analyzed right before.
    env.without_timeout(&["VACUUM ANALYZE outbox.messages"])
        .await?;
    env.settle().await?;
    let partitions: Vec<i16> = (0..64).collect();
    let per_partition = vec![32i64; partitions.len()];
    // From the start of each partition every time: the claim as it was before positions.
    let floors = vec![0i64; partitions.len()];
    let schema = shared::schema::Schema::default();
    let started = Instant::now();
    let mut done = 0u64;
    loop {
        let args = relay::store::ClaimArgs {
            partitions: &partitions,
            per_partition: &per_partition,
            floors: &floors,
            limit: 1000,
            held: &[],
            late_running: &[],
            late_from: None,
            statements: relay::store::Statements::Prepared,
        };
        let (rows, _) = relay::store::claim(&env.pool, &schema, "bench", &args).await?;
        let seqs: Vec<i64> = rows
            .iter()
            .map(|c| match c {
                relay::store::Claimed::Row(r) => r.seq,
                relay::store::Claimed::Undecodable { seq, .. } => *seq,
            })
            .collect();
        if seqs.is_empty() {
            break;
        }
        relay::store::mark_published(
            &env.pool,
            &schema,
            &seqs,
            false,
            relay::store::Statements::Prepared,
        )
        .await?;
        done += seqs.len() as u64;
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    sqlx::query("UPDATE outbox.relay_partitions SET owner = NULL, lease_until = '-infinity'")
        .execute(&env.pool)
        .await?;
    Ok(rate)
}
