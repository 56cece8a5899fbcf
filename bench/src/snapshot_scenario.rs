//! `old-snapshot`: the relay while another transaction holds back vacuum (issue 39).
//!
//! Producers commit at a fixed rate (2,000 msg/s in 10-row transactions at scale 1); one relay
//! publishes to a queue the bench drains. After a warm-up, a `REPEATABLE READ` transaction takes a
//! snapshot (`SELECT count(*) FROM pg_class`: it touches no table of ours) and holds it. Every
//! interval the scenario reports the relay's mean claim time (`relay_db_duration_seconds{op=
//! "claim"}`, scraped), the lag (committed − delivered) and PostgreSQL's CPU per message. The same
//! run without the snapshot comes first, in the same invocation, as the baseline.
//!
//! `BENCH_SNAPSHOT_SECS` sets how long the snapshot is held (default 180 s at scale 1, at least 10 s; the issue's
//! targets are for 30 minutes: `BENCH_SNAPSHOT_SECS=1800`). `BENCH_SNAPSHOT_PARTS` picks parts: `relay`,
//! `processes`, `inserts`, `consumer` (the example's consumer, dedup and its sweep), `ordered` (the
//! same consumer in ordered mode: positions and held messages).

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
#[derive(Debug, Clone, Default)]
struct Sample {
    at: Duration,
    claim_ms: f64,
    lag: i64,
    pg_ms_per_1000: f64,
    /// PostgreSQL's CPU per 1,000 by client ([`env::PgCpu`]): "relay 60, bench 40, ...".
    by_client: String,
}

/// "relay 60, bench 40": `ms` per 1,000 of `n`.
fn by_client(ms: &[(String, f64)], n: i64) -> String {
    ms.iter()
        .filter(|(_, v)| *v >= 0.5)
        .map(|(who, v)| format!("{who} {:.0}", v / n.max(1) as f64 * 1000.0))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The last interval's PostgreSQL CPU by client, baseline and held, for a note.
fn last_by_client(base: &[Sample], held: &[Sample]) -> String {
    let last = |v: &[Sample]| v.last().map(|s| s.by_client.clone()).unwrap_or_default();
    format!(
        "PostgreSQL by client in the last interval, ms per 1,000 (baseline | held): {} | {}",
        last(base),
        last(held)
    )
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

/// The 10 rows producer `p` commits in its `i`-th transaction.
type Batch = fn(&str, u64, u64) -> Vec<shared::NewMessage>;

/// The relay part's rows: `producer_messages`, 1,000 aggregates per producer.
fn relay_batch(_: &str, p: u64, i: u64) -> Vec<shared::NewMessage> {
    producer_messages(p, i, 10, "bench.snapshot")
}

/// The consumer parts' rows: 250 aggregates per producer named after the run (`prefix`), so each
/// starts at number 1 for the run's consumer.
fn consumer_batch(prefix: &str, p: u64, i: u64) -> Vec<shared::NewMessage> {
    (0..10)
        .map(|k| {
            let n = i * 10 + k;
            shared::NewMessage::new(
                "bench",
                format!("{prefix}-{p}-{}", n % 250),
                "bench.snapshot",
                crate::scenarios::payload(n),
            )
        })
        .collect()
}

/// Commits `rate` messages a second in 10-row transactions (`batch`) on 4 connections until
/// `stop`.
fn produce(
    env: &BenchEnv,
    rate: u64,
    batch: Batch,
    prefix: &str,
    committed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let per_task = rate / 4 / 10;
    (0..4u64)
        .map(|p| {
            let (pool, committed, stop) = (env.pool.clone(), committed.clone(), stop.clone());
            let prefix = prefix.to_string();
            tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval(Duration::from_secs(1) / per_task.max(1) as u32);
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    shared::outbox::enqueue_many(&pool, &batch(&prefix, p, i)).await?;
                    committed.fetch_add(10, Ordering::Relaxed);
                    i += 1;
                }
                Ok(())
            })
        })
        .collect()
}

/// When `snapshot`, a `REPEATABLE READ` transaction that has taken its snapshot and holds it
/// until it is rolled back (it touches no table of ours).
async fn hold_snapshot(
    env: &BenchEnv,
    snapshot: bool,
) -> anyhow::Result<Option<sqlx::Transaction<'static, sqlx::Postgres>>> {
    if !snapshot {
        return Ok(None);
    }
    let mut tx = env.pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await?;
    // Held idle on purpose: a database's idle-in-transaction timeout must not end it.
    sqlx::query("SET LOCAL idle_in_transaction_session_timeout = 0")
        .execute(&mut *tx)
        .await?;
    let _: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class")
        .fetch_one(&mut *tx)
        .await?;
    Ok(Some(tx))
}

/// Size and dead tuples of `tables` (schema-qualified) after a run: "outbox.messages 412 MB, 0
/// dead; ...".
async fn table_sizes(env: &BenchEnv, tables: &[&str]) -> anyhow::Result<String> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT schemaname || '.' || relname, pg_total_relation_size(relid), n_dead_tup \
         FROM pg_stat_user_tables WHERE schemaname || '.' || relname = ANY($1) ORDER BY 1",
    )
    .bind(tables)
    .fetch_all(&env.pool)
    .await?;
    Ok(rows
        .iter()
        .map(|(t, size, dead)| format!("{t} {:.1} MB, {dead} dead", *size as f64 / 1e6))
        .collect::<Vec<_>>()
        .join("; "))
}

/// What the producers' part reports.
const PRODUCER_TABLES: [&str; 5] = [
    "outbox.messages",
    "outbox.aggregate_sequences",
    "outbox.processes",
    "outbox.process_steps",
    "outbox.process_history",
];

/// What the consumer parts report (`demo.timeline` is the example consumer's effect).
const CONSUMER_TABLES: [&str; 5] = [
    "outbox.processed_messages",
    "outbox.consumer_positions",
    "outbox.consumer_held",
    "outbox.consumer_partitions",
    "demo.timeline",
];

/// Producers at full speed (4 connections, 10-row transactions, 1,000 aggregates each, no relay
/// but its counter purge), with or without a snapshot held: the insert rate per interval, and the
/// tables afterwards.
async fn run_inserts(
    env: &BenchEnv,
    snapshot: bool,
    hold: Duration,
    every: Duration,
) -> anyhow::Result<(Vec<f64>, String)> {
    env.reset_outbox().await?;
    let committed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..4u64)
        .map(|p| {
            let (pool, committed, stop) = (env.pool.clone(), committed.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let msgs = producer_messages(p, i, 10, "bench.snapshot");
                    shared::outbox::enqueue_many(&pool, &msgs).await?;
                    committed.fetch_add(10, Ordering::Relaxed);
                    i += 1;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    // What a relay would run beside them: the counter purge (relay::counters), once a minute.
    let purge_stop = tokio_util::sync::CancellationToken::new();
    let purge = tokio::spawn(relay::counters::purge_loop(
        env.pool.clone(),
        shared::schema::Schema::default(),
        purge_stop.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(20).min(hold / 2)).await;
    let holder = hold_snapshot(env, snapshot).await?;
    let start = Instant::now();
    let mut rates = Vec::new();
    let (mut t0, mut c0) = (Instant::now(), committed.load(Ordering::Relaxed));
    while start.elapsed() < hold {
        tokio::time::sleep(every.min(hold - start.elapsed())).await;
        let c = committed.load(Ordering::Relaxed);
        rates.push((c - c0) as f64 / t0.elapsed().as_secs_f64());
        (t0, c0) = (Instant::now(), c);
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    purge_stop.cancel();
    let _ = purge.await;
    // Measured before the snapshot ends: what it held back.
    let sizes = table_sizes(env, &PRODUCER_TABLES).await?;
    if let Some(tx) = holder {
        tx.rollback().await?;
    }
    Ok((rates, sizes))
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
    let producers = produce(env, rate, relay_batch, "", committed.clone(), stop.clone());
    tokio::time::sleep(Duration::from_secs(20).min(hold / 2)).await;

    let holder = hold_snapshot(env, snapshot).await?;
    let start = Instant::now();
    let mut samples = Vec::new();
    let (mut sum0, mut n0) = claim_totals(&http, addr).await?;
    let mut cpu0 = env::CpuSnapshot::take();
    let mut pg0 = env::PgCpu::take(&env.pool).await;
    let mut c0 = committed.load(Ordering::Relaxed);
    while start.elapsed() < hold {
        tokio::time::sleep(every.min(hold - start.elapsed())).await;
        let (sum, n) = claim_totals(&http, addr).await?;
        let cpu = env::CpuSnapshot::take();
        let pg = env::PgCpu::take(&env.pool).await;
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
            by_client: by_client(&pg.ms_since(&pg0), msgs as i64),
        });
        (sum0, n0, cpu0, c0, pg0) = (sum, n, cpu, c, pg);
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

/// The process worker under the same condition: processes started at `rate` a second (10 a
/// transaction), one worker; samples the lag (started − succeeded) and PostgreSQL's CPU per
/// process. Returns the samples and the processes done in the hold.
async fn run_processes(
    env: &BenchEnv,
    snapshot: bool,
    hold: Duration,
    every: Duration,
    rate: u64,
) -> anyhow::Result<(Vec<Sample>, u64)> {
    let kind = if snapshot {
        "bench_snap_held"
    } else {
        "bench_snap_base"
    };
    let def = processes::Definition::new(kind, 1).step(processes::Step::local(
        "noop",
        system_tests::process_fixtures::Noop,
    ));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(24)
        .connect(&env.db_url)
        .await?;
    let mut config =
        processes::WorkerConfig::new(pool.clone(), shared::schema::Schema::default(), kind);
    config.concurrency = 16;
    let stop = tokio_util::sync::CancellationToken::new();
    let registry = processes::Registry::new().with(def.clone())?;
    let s = stop.clone();
    let worker = tokio::spawn(async move { processes::Worker::run(config, registry, s).await });
    let started = Arc::new(AtomicU64::new(0));
    let halt = Arc::new(AtomicBool::new(false));
    let (p, st, h, d) = (env.pool.clone(), started.clone(), halt.clone(), def.clone());
    let producer = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1) / (rate / 10).max(1) as u32);
        let mut i = 0u64;
        while !h.load(Ordering::Relaxed) {
            tick.tick().await;
            let mut tx = p.begin().await?;
            for _ in 0..10 {
                processes::start_in(
                    &mut tx,
                    &shared::schema::Schema::default(),
                    &d,
                    &format!("p{i}"),
                    &serde_json::json!({}),
                )
                .await?;
                i += 1;
            }
            tx.commit().await?;
            st.fetch_add(10, Ordering::Relaxed);
        }
        anyhow::Ok(())
    });
    let done = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox.processes WHERE kind = $1 AND status = 'succeeded'",
        )
        .bind(kind)
        .fetch_one(&pool)
        .await
    };
    tokio::time::sleep(Duration::from_secs(20).min(hold / 2)).await;
    let holder = hold_snapshot(env, snapshot).await?;
    let start = Instant::now();
    let first = done(env.pool.clone()).await?;
    let mut samples = Vec::new();
    let mut cpu0 = env::CpuSnapshot::take();
    let mut pg0 = env::PgCpu::take(&env.pool).await;
    let mut d0 = first;
    while start.elapsed() < hold {
        tokio::time::sleep(every.min(hold - start.elapsed())).await;
        let cpu = env::CpuSnapshot::take();
        let pg = env::PgCpu::take(&env.pool).await;
        let d = done(env.pool.clone()).await?;
        samples.push(Sample {
            at: start.elapsed(),
            claim_ms: 0.0,
            lag: started.load(Ordering::Relaxed) as i64 - d,
            pg_ms_per_1000: cpu.group_ms_since(&cpu0, "postgres") / (d - d0).max(1) as f64 * 1000.0,
            by_client: by_client(&pg.ms_since(&pg0), d - d0),
        });
        (cpu0, d0, pg0) = (cpu, d, pg);
    }
    let in_hold = (d0 - first).max(0) as u64;
    if let Some(tx) = holder {
        tx.rollback().await?;
    }
    halt.store(true, Ordering::Relaxed);
    producer.await??;
    stop.cancel();
    let _ = worker.await;
    pool.close().await;
    Ok((samples, in_hold))
}

/// A consumer under the same condition: the example's `producer timeline` (its effect one row in
/// `demo.timeline`), ordered or not, with a short retention so its dedup sweep deletes while the
/// snapshot is held. Producers commit `rate` messages a second over 1,000 aggregates (named after
/// the run, so each starts at number 1 for this consumer); one relay publishes them. Samples the
/// lag (committed − applied) and PostgreSQL's CPU per message; returns them and the consumer's
/// tables before the snapshot ends.
async fn run_consumer(
    env: &BenchEnv,
    ordered: bool,
    snapshot: bool,
    hold: Duration,
    every: Duration,
    rate: u64,
) -> anyhow::Result<(Vec<Sample>, String)> {
    env.reset_outbox().await?;
    let name = format!(
        "{}-snap-{}-{}",
        env.exchange.replace('.', "-"),
        if ordered { "o" } else { "u" },
        if snapshot { "held" } else { "base" }
    );
    let mut args = vec![
        "timeline",
        "--name",
        name.as_str(),
        "--bind",
        "#",
        "--retry-delays",
        "1s",
        "--retention",
        "60s",
        "--retention-interval",
        "10s",
    ];
    if ordered {
        args.push("--ordered");
    }
    let probe = if ordered {
        consumer::ordered::topology::queue(&name, 0)
    } else {
        name.clone()
    };
    let consumer = env.spawn("producer", &args, &[])?;
    crate::consumer_scenario::wait_queue_consumed(&env.conn, &probe).await?;
    let relay = env.spawn("relay", &[], &[])?;
    crate::relay_scenario::wait_partitions_split(env, 1).await?;
    let applied = |pool: sqlx::PgPool, name: String| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM demo.timeline WHERE consumer = $1")
            .bind(name)
            .fetch_one(&pool)
            .await
    };
    let committed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let producers = produce(
        env,
        rate,
        consumer_batch,
        &name,
        committed.clone(),
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(20).min(hold / 2)).await;
    let holder = hold_snapshot(env, snapshot).await?;
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut cpu0 = env::CpuSnapshot::take();
    let mut pg0 = env::PgCpu::take(&env.pool).await;
    let mut a0 = applied(env.pool.clone(), name.clone()).await?;
    while start.elapsed() < hold {
        tokio::time::sleep(every.min(hold - start.elapsed())).await;
        let cpu = env::CpuSnapshot::take();
        let pg = env::PgCpu::take(&env.pool).await;
        let a = applied(env.pool.clone(), name.clone()).await?;
        samples.push(Sample {
            at: start.elapsed(),
            claim_ms: 0.0,
            lag: committed.load(Ordering::Relaxed) as i64 - a,
            pg_ms_per_1000: cpu.group_ms_since(&cpu0, "postgres") / (a - a0).max(1) as f64 * 1000.0,
            by_client: by_client(&pg.ms_since(&pg0), a - a0),
        });
        (cpu0, a0, pg0) = (cpu, a, pg);
    }
    let sizes = table_sizes(env, &CONSUMER_TABLES).await?;
    if let Some(tx) = holder {
        tx.rollback().await?;
    }
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await??;
    }
    // Let the consumer catch up, then check what it applied.
    let total = committed.load(Ordering::Relaxed) as i64;
    let deadline = Instant::now() + Duration::from_secs(300);
    while applied(env.pool.clone(), name.clone()).await? < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    env::stop(relay).await;
    env::stop(consumer).await;
    let done = applied(env.pool.clone(), name.clone()).await?;
    anyhow::ensure!(done == total, "{name}: {done} of {total} applied");
    if ordered {
        let v = demo::timeline::violations(&env.pool, &name).await?;
        anyhow::ensure!(
            v == demo::timeline::Violations::default(),
            "{name}: {v:?} in demo.timeline"
        );
    }
    crate::ordered_scenario::delete_topology(env, ordered, &name).await;
    Ok((samples, sizes))
}

/// Which parts of the scenario run (`BENCH_SNAPSHOT_PARTS`, comma-separated; all by default): a
/// 30-minute hold takes an hour per part, so a long run may take one part at a time.
const PARTS: [&str; 5] = ["relay", "processes", "inserts", "consumer", "ordered"];

fn parts() -> anyhow::Result<Vec<String>> {
    let Ok(v) = std::env::var("BENCH_SNAPSHOT_PARTS") else {
        return Ok(PARTS.iter().map(|s| s.to_string()).collect());
    };
    let parts: Vec<String> = v.split(',').map(|s| s.trim().to_string()).collect();
    for p in &parts {
        anyhow::ensure!(
            PARTS.contains(&p.as_str()),
            "BENCH_SNAPSHOT_PARTS: unknown part {p:?}; the parts are {}",
            PARTS.join(", ")
        );
    }
    Ok(parts)
}

/// The consumer parts' lines: throughput held against the baseline, the lag at the end, and the
/// per-interval table with the consumer's tables after each run.
fn consumer_lines(
    label: &str,
    rate: u64,
    hold: Duration,
    (base, sizes_base): &(Vec<Sample>, String),
    (held, sizes_held): &(Vec<Sample>, String),
) -> Vec<Line> {
    let table: Vec<String> = base
        .iter()
        .zip(held)
        .map(|(b, h)| {
            format!(
                "{:>4.0}s: lag {} / {}, PostgreSQL {:.0} / {:.0} ms per 1,000",
                h.at.as_secs_f64(),
                b.lag,
                h.lag,
                b.pg_ms_per_1000,
                h.pg_ms_per_1000
            )
        })
        .collect();
    let mean =
        |v: &[Sample], f: fn(&Sample) -> f64| v.iter().map(f).sum::<f64>() / v.len().max(1) as f64;
    let (pb, ph) = (
        mean(base, |s| s.pg_ms_per_1000),
        mean(held, |s| s.pg_ms_per_1000),
    );
    vec![
        Line::new(
            &format!("old-snapshot {label} lag, held"),
            held.last().map_or(0.0, |s| s.lag as f64),
            "msgs",
        )
        .at_most(rate as f64)
        .note(format!(
            "`producer timeline` ({label}), {rate} msg/s over 1,000 aggregates, dedup retention 60 s swept every 10 s; a snapshot held {:.0} s (baseline / held, per interval): {}; tables after the baseline: {sizes_base}; after the held run (before the snapshot ends): {sizes_held}; {}",
            hold.as_secs_f64(),
            table.join("; "),
            last_by_client(base, held)
        )),
        Line::new(
            &format!("old-snapshot {label} PostgreSQL CPU, held / baseline"),
            ph / pb.max(0.001),
            "x",
        )
        .at_most(1.5)
        .note(format!(
            "{ph:.0} against {pb:.0} ms of PostgreSQL CPU per 1,000 messages applied"
        )),
    ]
}

pub async fn old_snapshot(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let hold = std::env::var("BENCH_SNAPSHOT_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map(Duration::from_secs)
        .unwrap_or_else(|| env.secs(180.0, 10.0));
    let every = (hold / 6).max(Duration::from_secs(10));
    let parts = parts()?;
    let part = |p: &str| parts.iter().any(|x| x == p);
    let mut lines = Vec::new();
    if part("relay") {
        lines.extend(relay_part(env, hold, every).await?);
    }
    if part("processes") {
        lines.extend(processes_part(env, hold, every).await?);
    }
    if part("inserts") {
        lines.extend(inserts_part(env, hold, every).await?);
    }
    for (p, ordered, label) in [
        ("consumer", false, "consumer"),
        ("ordered", true, "ordered consumer"),
    ] {
        if part(p) {
            let rate = env.n(1000, 100);
            let base = run_consumer(env, ordered, false, hold, every, rate).await?;
            let held = run_consumer(env, ordered, true, hold, every, rate).await?;
            lines.extend(consumer_lines(label, rate, hold, &base, &held));
        }
    }
    Ok(lines)
}

/// The relay: claim time, lag and PostgreSQL CPU, held against the baseline.
async fn relay_part(env: &BenchEnv, hold: Duration, every: Duration) -> anyhow::Result<Vec<Line>> {
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
        base.last().cloned().unwrap_or_default(),
        held.last().cloned().unwrap_or_default(),
    );
    let mean =
        |v: &[Sample], f: fn(&Sample) -> f64| v.iter().map(f).sum::<f64>() / v.len().max(1) as f64;
    lines.push(
        Line::new("old-snapshot claim, held", h.claim_ms, "ms")
            .vs_ceiling(b.claim_ms.max(0.001) * 2.0, None)
            .note(format!(
                "{rate} msg/s in 10-row transactions, one relay; a REPEATABLE READ snapshot held {:.0} s (baseline / held, per interval): {}; {}",
                hold.as_secs_f64(),
                table.join("; "),
                last_by_client(&base, &held)
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

/// The process worker: processes started at a fixed rate, with and without the snapshot.
async fn processes_part(
    env: &BenchEnv,
    hold: Duration,
    every: Duration,
) -> anyhow::Result<Vec<Line>> {
    let mut lines = Vec::new();
    let prate = env.n(300, 50);
    let (pbase, pdone_base) = run_processes(env, false, hold, every, prate).await?;
    let (pheld, pdone_held) = run_processes(env, true, hold, every, prate).await?;
    let ptable: Vec<String> = pbase
        .iter()
        .zip(&pheld)
        .map(|(b, h)| {
            format!(
                "{:>4.0}s: lag {} / {}, PostgreSQL {:.0} / {:.0} ms per 1,000",
                h.at.as_secs_f64(),
                b.lag,
                h.lag,
                b.pg_ms_per_1000,
                h.pg_ms_per_1000
            )
        })
        .collect();
    lines.push(
        Line::new("old-snapshot processes, held", pdone_held as f64 / hold.as_secs_f64(), "proc/s")
            .vs_ceiling(pdone_base as f64 / hold.as_secs_f64(), Some(0.8))
            .note(format!(
                "one worker, one-step processes started at {prate}/s in 10-process transactions (baseline / held): {}; {}",
                ptable.join("; "),
                last_by_client(&pbase, &pheld)
            )),
    );
    lines.push(
        Line::new(
            "old-snapshot processes lag, held",
            pheld.last().map_or(0.0, |s| s.lag as f64),
            "procs",
        )
        .at_most(prate as f64),
    );
    Ok(lines)
}

/// Producers' inserts at full speed (the aggregate counters are updated in each transaction).
async fn inserts_part(
    env: &BenchEnv,
    hold: Duration,
    every: Duration,
) -> anyhow::Result<Vec<Line>> {
    let mut lines = Vec::new();
    let (ibase, sizes_base) = run_inserts(env, false, hold, every).await?;
    let (iheld, sizes_held) = run_inserts(env, true, hold, every).await?;
    let itable: Vec<String> = ibase
        .iter()
        .zip(&iheld)
        .enumerate()
        .map(|(i, (b, h))| {
            format!(
                "{:>4.0}s: {b:.0} / {h:.0} msg/s",
                ((i + 1) as f64) * every.as_secs_f64()
            )
        })
        .collect();
    let last = |v: &[f64]| v.last().copied().unwrap_or(0.0);
    lines.push(
        Line::new("old-snapshot producer inserts, held", last(&iheld), "msg/s")
            .vs_ceiling(last(&ibase), Some(0.85))
            .note(format!(
                "4 producers at full speed, 10-row transactions, 4,000 aggregates, no relay but its counter purge once a minute (baseline / held, per interval): {}; tables after the baseline: {sizes_base}; after the held run (before the snapshot ends): {sizes_held}",
                itable.join("; ")
            )),
    );
    Ok(lines)
}
