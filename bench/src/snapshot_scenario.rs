//! `old-snapshot`: the relay while another transaction holds back vacuum (issue 39).
//!
//! Producers commit at a fixed rate (2,000 msg/s in 10-row transactions at scale 1); one relay
//! publishes to a queue the bench drains. After a warm-up, a `REPEATABLE READ` transaction takes a
//! snapshot (`SELECT count(*) FROM pg_class`: it touches no table of ours) and holds it. Every
//! interval the scenario reports the relay's mean claim time (`relay_db_duration_seconds{op=
//! "claim"}`, scraped), the lag (committed − delivered) and PostgreSQL's CPU per message. The same
//! run without the snapshot comes first, in the same invocation, as the baseline.
//!
//! `BENCH_SNAPSHOT_SECS` sets how long the snapshot is held (default 180 s at scale 1; the issue's
//! targets are for 30 minutes: `BENCH_SNAPSHOT_SECS=1800`).

use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::producer_messages;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What one interval measured.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    at: Duration,
    claim_ms: f64,
    lag: i64,
    pg_ms_per_1000: f64,
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// The relay's claim time so far: (sum in seconds, count).
async fn claim_totals(http: &reqwest::Client, addr: SocketAddr) -> anyhow::Result<(f64, f64)> {
    let text = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let value = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains("op=\"claim\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok((
        value("relay_db_duration_seconds_sum"),
        value("relay_db_duration_seconds_count"),
    ))
}

/// Commits `rate` messages a second in 10-row transactions on 4 connections until `stop`.
fn produce(
    env: &BenchEnv,
    rate: u64,
    committed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let per_task = rate / 4 / 10;
    (0..4u64)
        .map(|p| {
            let (pool, committed, stop) = (env.pool.clone(), committed.clone(), stop.clone());
            tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval(Duration::from_secs(1) / per_task.max(1) as u32);
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let msgs = producer_messages(p, i, 10, "bench.snapshot");
                    shared::outbox::enqueue_many(&pool, &msgs).await?;
                    committed.fetch_add(10, Ordering::Relaxed);
                    i += 1;
                }
                Ok(())
            })
        })
        .collect()
}

/// One run: warm-up, then `hold` with or without a snapshot held, sampled every `every`.
async fn run(
    env: &BenchEnv,
    queue: &str,
    snapshot: bool,
    hold: Duration,
    every: Duration,
    rate: u64,
) -> anyhow::Result<Vec<Sample>> {
    env.reset_outbox().await?;
    let addr = free_addr();
    let relay = env.spawn("relay", &[], &[("METRICS_ADDR", &addr.to_string())])?;
    crate::relay_scenario::wait_partitions_split(env, 1).await?;
    let http = reqwest::Client::new();
    let delivered = Arc::new(AtomicU64::new(0));
    let ch = env.conn.create_channel().await?;
    ch.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            format!("snapshot-{snapshot}").as_str().into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let d = delivered.clone();
    let drain = tokio::spawn(async move {
        while let Some(Ok(_)) = consumer.next().await {
            d.fetch_add(1, Ordering::Relaxed);
        }
    });
    let committed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let producers = produce(env, rate, committed.clone(), stop.clone());
    tokio::time::sleep(Duration::from_secs(20).min(hold / 2)).await;

    let mut holder = None;
    if snapshot {
        let mut tx = env.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await?;
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class")
            .fetch_one(&mut *tx)
            .await?;
        holder = Some(tx);
    }
    let start = Instant::now();
    let mut samples = Vec::new();
    let (mut sum0, mut n0) = claim_totals(&http, addr).await?;
    let mut cpu0 = env::CpuSnapshot::take();
    let mut c0 = committed.load(Ordering::Relaxed);
    while start.elapsed() < hold {
        tokio::time::sleep(every.min(hold - start.elapsed())).await;
        let (sum, n) = claim_totals(&http, addr).await?;
        let cpu = env::CpuSnapshot::take();
        let c = committed.load(Ordering::Relaxed);
        let lag = c as i64 - delivered.load(Ordering::Relaxed) as i64;
        let msgs = (c - c0).max(1);
        samples.push(Sample {
            at: start.elapsed(),
            claim_ms: if n > n0 {
                (sum - sum0) / (n - n0) * 1000.0
            } else {
                0.0
            },
            lag,
            pg_ms_per_1000: cpu.group_ms_since(&cpu0, "postgres") / msgs as f64 * 1000.0,
        });
        (sum0, n0, cpu0, c0) = (sum, n, cpu, c);
    }
    if let Some(tx) = holder {
        tx.rollback().await?;
    }
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await??;
    }
    // Let the relay catch up before the next run.
    let deadline = Instant::now() + Duration::from_secs(300);
    while delivered.load(Ordering::Relaxed) < committed.load(Ordering::Relaxed)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env::stop(relay).await;
    drain.abort();
    let _ = ch.close(200, "done".into()).await;
    Ok(samples)
}

pub async fn old_snapshot(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let hold = std::env::var("BENCH_SNAPSHOT_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map(Duration::from_secs)
        .unwrap_or_else(|| env.secs(180.0, 30.0));
    let every = (hold / 6).max(Duration::from_secs(10));
    let rate = env.n(2000, 200);
    let queue = env.queue("snapshot", "bench.snapshot").await?;
    let base = run(env, &queue, false, hold, every, rate).await?;
    let held = run(env, &queue, true, hold, every, rate).await?;
    env.delete_queue(&queue).await;
    let mut lines = Vec::new();
    let table: Vec<String> = base
        .iter()
        .zip(&held)
        .map(|(b, h)| {
            format!(
                "{:>4.0}s: claim {:.2} / {:.2} ms, lag {} / {}, PostgreSQL {:.0} / {:.0} ms per 1,000",
                h.at.as_secs_f64(),
                b.claim_ms,
                h.claim_ms,
                b.lag,
                h.lag,
                b.pg_ms_per_1000,
                h.pg_ms_per_1000
            )
        })
        .collect();
    let (b, h) = (
        base.last().copied().unwrap_or_default(),
        held.last().copied().unwrap_or_default(),
    );
    let mean =
        |v: &[Sample], f: fn(&Sample) -> f64| v.iter().map(f).sum::<f64>() / v.len().max(1) as f64;
    lines.push(
        Line::new("old-snapshot claim, held", h.claim_ms, "ms")
            .vs_ceiling(b.claim_ms.max(0.001) * 2.0, None)
            .note(format!(
                "{rate} msg/s in 10-row transactions, one relay; a REPEATABLE READ snapshot held {:.0} s (baseline / held, per interval): {}",
                hold.as_secs_f64(),
                table.join("; ")
            )),
    );
    lines.push(
        Line::new(
            "old-snapshot claim, held / baseline",
            h.claim_ms / b.claim_ms.max(0.001),
            "x",
        )
        .at_most(2.0),
    );
    lines.push(Line::new("old-snapshot lag, held", h.lag as f64, "msgs").at_most(rate as f64));
    let (pb, ph) = (
        mean(&base, |s| s.pg_ms_per_1000),
        mean(&held, |s| s.pg_ms_per_1000),
    );
    lines.push(
        Line::new(
            "old-snapshot PostgreSQL CPU, held / baseline",
            ph / pb.max(0.001),
            "x",
        )
        .at_most(1.5)
        .note(format!(
            "{ph:.0} against {pb:.0} ms of PostgreSQL CPU per 1,000 messages"
        )),
    );
    Ok(lines)
}
