//! The `processes` scenario: a 3-step no-op process (local steps) run by several workers.
//!
//! Measures, in one run: the PostgreSQL commit ceiling (single-row autocommit INSERTs on as many
//! connections as the workers use); the drain rate of a backlog (processes/s, steps/s, where the
//! CPU went), once with workers started for it (cold: connections, prepared statements and
//! PL/pgSQL caches are made during it) and once with the same workers running (warm: the
//! backlog committed in one transaction, the steady state of long-running workers); the
//! start-to-succeeded latency at a steady 100 processes/s (from the database's own timestamps);
//! and the round trips, statements and commits per step, counted on the wire by a proxy in front
//! of warm workers' connections ([`crate::wire_count`]) in a separate drain (the proxy costs CPU
//! of its own, so the timed drains run without it). `pg_stat_database` is not used for commits:
//! backends report to it up to seconds late, which skews windows of a few seconds.

use crate::env::{BenchEnv, CpuSnapshot};
use crate::report::Line;
use crate::wire_count::WireCounter;
use hdrhistogram::Histogram;
use processes::{
    Definition, Done, LocalStep, Registry, Step, StepContext, StepFuture, Worker, WorkerConfig,
};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Workers (each its own pool), `BENCH_PROCESS_WORKERS` (default 4).
fn workers() -> usize {
    env_usize("BENCH_PROCESS_WORKERS", 4)
}

/// Processes each worker runs at once, `BENCH_PROCESS_CONCURRENCY` (default 16).
fn concurrency() -> usize {
    env_usize("BENCH_PROCESS_CONCURRENCY", 16)
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// A local step that does nothing but finish (the waiting scenario's too).
pub(crate) struct Noop;

impl LocalStep for Noop {
    fn run<'a>(&'a self, ctx: &'a StepContext, _tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move { Ok(Done::new(ctx.step.clone())) })
    }
}

fn definition() -> Definition {
    Definition::new("bench_noop", 1)
        .step(Step::local("one", Noop))
        .step(Step::local("two", Noop))
        .step(Step::local("three", Noop))
}

async fn succeeded(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox.processes WHERE status = 'succeeded'")
            .fetch_one(pool)
            .await?,
    )
}

async fn start_many(pool: &PgPool, from: u64, n: u64) -> anyhow::Result<()> {
    let def = definition();
    let mut tasks = tokio::task::JoinSet::new();
    let per = n.div_ceil(8);
    for c in 0..8u64 {
        let pool = pool.clone();
        let def = def.clone();
        tasks.spawn(async move {
            for i in (from + c * per)..(from + ((c + 1) * per).min(n)) {
                processes::start(
                    &pool,
                    &def,
                    &format!("p{i}"),
                    &serde_json::json!({ "i": i }),
                )
                .await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// Starts `n` processes in one transaction: the workers see the whole backlog at its commit.
/// Returns the database's clock just before the commit (a drain timed from it is not shorter
/// than it was).
async fn start_backlog(
    pool: &PgPool,
    from: u64,
    n: u64,
) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    let def = definition();
    let schema = Schema::default();
    let mut tx = pool.begin().await?;
    for i in from..from + n {
        let key = format!("p{i}");
        processes::start_in(&mut tx, &schema, &def, &key, &serde_json::json!({ "i": i })).await?;
    }
    let at = db_now(&mut *tx).await?;
    tx.commit().await?;
    Ok(at)
}

/// What autovacuum would have done by now (it may be off on a test server, as it is here): dead
/// rows of earlier phases removed, statistics of the grown tables.
async fn vacuum(env: &BenchEnv) -> anyhow::Result<()> {
    env.without_timeout(&[
        "VACUUM ANALYZE outbox.processes",
        "VACUUM ANALYZE outbox.process_steps",
        "VACUUM ANALYZE outbox.process_history",
    ])
    .await
}

struct Workers {
    stop: CancellationToken,
    handles: Vec<tokio::task::JoinHandle<()>>,
    pools: Vec<PgPool>,
}

async fn spawn_workers(url: &str) -> anyhow::Result<Workers> {
    let stop = CancellationToken::new();
    let mut handles = Vec::new();
    let mut pools = Vec::new();
    let (workers, concurrency) = (workers(), concurrency());
    for w in 0..workers {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(concurrency as u32 + 2)
            .connect(url)
            .await?;
        let mut config = WorkerConfig::new(pool.clone(), Schema::default(), format!("bench-{w}"));
        config.concurrency = concurrency;
        config.claim_batch = concurrency as i64;
        config.poll_interval = Duration::from_millis(200);
        config.stats_interval = Duration::from_secs(3600);
        let registry = Registry::new().with(definition())?;
        let s = stop.clone();
        handles.push(tokio::spawn(async move {
            if let Err(e) = Worker::run(config, registry, s).await {
                eprintln!("worker failed: {e}");
            }
        }));
        pools.push(pool);
    }
    Ok(Workers {
        stop,
        handles,
        pools,
    })
}

impl Workers {
    async fn stop(self) {
        self.stop.cancel();
        for h in self.handles {
            let _ = h.await;
        }
        for p in self.pools {
            p.close().await;
        }
    }
}

/// Single-row autocommit INSERTs on `connections` connections for `secs`: commits/s.
async fn commit_ceiling(env: &BenchEnv, connections: usize, secs: Duration) -> anyhow::Result<f64> {
    sqlx::query("CREATE TABLE IF NOT EXISTS public.bench_commits (id bigserial PRIMARY KEY, at timestamptz DEFAULT now())")
        .execute(&env.pool)
        .await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections as u32)
        .connect(&env.db_url)
        .await?;
    let deadline = Instant::now() + secs;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let pool = pool.clone();
        tasks.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                sqlx::query("INSERT INTO public.bench_commits DEFAULT VALUES")
                    .execute(&pool)
                    .await?;
                n += 1;
            }
            anyhow::Ok(n)
        });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r??;
    }
    let rate = total as f64 / started.elapsed().as_secs_f64();
    pool.close().await;
    sqlx::query("DROP TABLE public.bench_commits")
        .execute(&env.pool)
        .await?;
    Ok(rate)
}

/// The whole scenario, phase after phase: each phase leaves the processes it ran succeeded, so
/// `done` (processes succeeded so far) is carried from one to the next.
pub async fn run(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let mut lines = Vec::new();
    env.settle().await?;
    let ceiling = measure_ceiling(env, &mut lines).await?;
    let n = env.n(20_000, 500);
    let workers = cold_drain(env, n, &mut lines).await?;
    let mut done = n;
    let steps_per_s = warm_drain(env, &mut done, n, &mut lines).await?;
    steady_latency(env, &mut done, &mut lines).await?;
    workers.stop().await;
    wire_counts(env, done, steps_per_s, ceiling, &mut lines).await?;
    Ok(lines)
}

/// The commit ceiling on as many connections as the workers use: what the drains' commits/s are
/// measured against.
async fn measure_ceiling(env: &BenchEnv, lines: &mut Vec<Line>) -> anyhow::Result<f64> {
    let (n_workers, concurrency) = (workers(), concurrency());
    let ceiling = commit_ceiling(env, n_workers * concurrency, env.secs(5.0, 1.0)).await?;
    lines.push(
        Line::new("processes commit ceiling", ceiling, "commits/s").note(format!(
            "single-row autocommit INSERTs on {} connections",
            n_workers * concurrency
        )),
    );
    Ok(ceiling)
}

/// Cold drain: a backlog of `n` started before the workers, timed from the workers' start (their
/// connections, prepared statements and PL/pgSQL caches are made during it). Returns the
/// workers, kept running for the warm phases.
async fn cold_drain(env: &BenchEnv, n: u64, lines: &mut Vec<Line>) -> anyhow::Result<Workers> {
    let (n_workers, concurrency) = (workers(), concurrency());
    start_many(&env.pool, 0, n).await?;
    vacuum(env).await?;
    env.settle().await?;
    let started = Instant::now();
    let t0 = db_now(&env.pool).await?;
    let workers = spawn_workers(&env.db_url).await?;
    let t1 = wait_succeeded(&env.pool, n, started).await?;
    let cold = n as f64 / secs_between(t0, t1);
    lines.push(
        Line::new("processes drain, cold workers", cold, "processes/s").note(format!(
            "{n} processes started before {n_workers} new workers x {concurrency}, timed from the workers' start"
        )),
    );
    Ok(workers)
}

/// Warm drain: the same workers, now idle, get a backlog of `n` committed in one transaction.
/// Returns the steps/s, which the wire counts turn into commits/s.
async fn warm_drain(
    env: &BenchEnv,
    done: &mut u64,
    n: u64,
    lines: &mut Vec<Line>,
) -> anyhow::Result<f64> {
    let (n_workers, concurrency) = (workers(), concurrency());
    vacuum(env).await?;
    env.settle().await?;
    let t0 = start_backlog(&env.pool, *done, n).await?;
    let cpu = CpuSnapshot::take();
    let started = Instant::now();
    *done += n;
    let t1 = wait_succeeded(&env.pool, *done, started).await?;
    let took = secs_between(t0, t1);
    let cpu_note = CpuSnapshot::take().report_per(&cpu, n, "processes");
    let rate = n as f64 / took;
    let steps_per_s = 3.0 * n as f64 / took;
    lines.push(
        Line::new("processes drain", rate, "processes/s")
            .at_least(1000.0)
            .note(format!(
                "{n} 3-step no-op processes (local steps) committed at once, {n_workers} running workers x {concurrency}; {cpu_note}"
            )),
    );
    lines.push(Line::new("processes drain steps", steps_per_s, "steps/s"));
    Ok(steps_per_s)
}

/// Latency at a steady 100 processes/s, with the (running) workers idle between starts; read
/// from the database's own timestamps.
async fn steady_latency(
    env: &BenchEnv,
    done: &mut u64,
    lines: &mut Vec<Line>,
) -> anyhow::Result<()> {
    let secs = env.secs(20.0, 2.0);
    let total = (100.0 * secs.as_secs_f64()) as u64;
    let def = definition();
    let started = Instant::now();
    for i in 0..total {
        let due = started + Duration::from_millis(i * 10);
        tokio::time::sleep_until(due.into()).await;
        processes::start(
            &env.pool,
            &def,
            &format!("lat{i}"),
            &serde_json::json!({ "i": i }),
        )
        .await?;
    }
    *done += total;
    wait_succeeded(&env.pool, *done, started).await?;
    let micros: Vec<i64> = sqlx::query_scalar(
        "SELECT (extract(epoch FROM finished_at - created_at) * 1e6)::bigint FROM outbox.processes \
         WHERE business_key LIKE 'lat%' AND status = 'succeeded'",
    )
    .fetch_all(&env.pool)
    .await?;
    let mut h = Histogram::<u64>::new(3)?;
    for m in micros {
        h.record(m.max(0) as u64)?;
    }
    let ms = |us: u64| us as f64 / 1000.0;
    lines.push(Line::new(
        "processes start-to-succeeded p50",
        ms(h.value_at_quantile(0.5)),
        "ms",
    ));
    lines.push(
        Line::new("processes start-to-succeeded p99", ms(h.value_at_quantile(0.99)), "ms")
            .at_most(30.0)
            .note(format!("100 processes/s for {:.0} s; {} samples; start commit to the last step's commit (database clock)", secs.as_secs_f64(), h.len())),
    );
    lines.push(Line::new(
        "processes start-to-succeeded max",
        ms(h.max()),
        "ms",
    ));
    Ok(())
}

/// Round trips on the wire: new workers behind the proxy, warmed on a first backlog, then
/// counted while they drain a second one (committed at once, like the warm drain). The proxy
/// costs CPU of its own, which is why the timed drains run without it.
async fn wire_counts(
    env: &BenchEnv,
    mut done: u64,
    steps_per_s: f64,
    ceiling: f64,
    lines: &mut Vec<Line>,
) -> anyhow::Result<()> {
    let m = env.n(2_000, 300);
    let upstream = upstream_addr(&env.db_url).await?;
    let proxy = WireCounter::start(upstream).await?;
    let workers = spawn_workers(&proxy.url_for(&env.db_url)?).await?;
    let started = Instant::now();
    start_many(&env.pool, done, m).await?;
    done += m;
    wait_succeeded(&env.pool, done, started).await?;
    start_backlog(&env.pool, done, m).await?;
    let before = proxy.counts();
    let started = Instant::now();
    done += m;
    wait_succeeded(&env.pool, done, started).await?;
    let c = proxy.counts().since(&before);
    workers.stop().await;
    let steps = (3 * m) as f64;
    let per_step = |v: u64| v as f64 / steps;
    let mut kinds: Vec<(String, u64)> = c.statements.into_iter().collect();
    kinds.sort_by_key(|k| std::cmp::Reverse(k.1));
    let breakdown: Vec<String> = kinds
        .iter()
        .take(6)
        .map(|(k, v)| format!("{:.2} {k}", *v as f64 / m as f64))
        .collect();
    lines.push(
        Line::new("processes round trips per step", per_step(c.round_trips), "round trips").note(format!(
            "counted on the wire (Sync and Query messages) from warm workers' connections while they drained {m} processes; per process: {:.2} pings, {}",
            c.pings as f64 / m as f64,
            breakdown.join("; ")
        )),
    );
    let commits_per_step = per_step(c.transactions);
    lines.push(
        Line::new("processes commits per step", commits_per_step, "commits").note(
            "transactions ended on those connections (commits, autocommit statements and rollbacks, read-only ones included), counted on the wire",
        ),
    );
    lines.push(
        Line::new(
            "processes drain commits",
            steps_per_s * commits_per_step,
            "commits/s",
        )
        .vs_ceiling(ceiling, None)
        .note("drain steps/s x commits per step, against the same run's commit ceiling"),
    );
    Ok(())
}

const POLL: Duration = Duration::from_millis(20);

/// Waits until no process is left to run (one cheap query per [`POLL`]: the due index holds only
/// unfinished processes), then checks that `n` succeeded. Returns the database's time of the last
/// finish.
async fn wait_succeeded(
    pool: &PgPool,
    n: u64,
    started: Instant,
) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    loop {
        let busy: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outbox.processes \
             WHERE status IN ('pending', 'running', 'waiting', 'compensating') AND NOT paused)",
        )
        .fetch_one(pool)
        .await?;
        if !busy {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "processes still running after 10 minutes"
        );
        tokio::time::sleep(POLL).await;
    }
    let done = succeeded(pool).await?;
    anyhow::ensure!(done >= n as i64, "{done} processes succeeded, {n} expected");
    Ok(
        sqlx::query_scalar("SELECT max(finished_at) FROM outbox.processes")
            .fetch_one(pool)
            .await?,
    )
}

/// The database's clock, to time a drain against `finished_at`.
async fn db_now<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    Ok(sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(executor)
        .await?)
}

fn secs_between(from: chrono::DateTime<chrono::Utc>, to: chrono::DateTime<chrono::Utc>) -> f64 {
    (to - from).num_microseconds().unwrap_or(0).max(1) as f64 / 1e6
}

/// host:port of a `postgres://user@host:port/db` URL.
async fn upstream_addr(url: &str) -> anyhow::Result<std::net::SocketAddr> {
    let host_port = url
        .split_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .ok_or_else(|| anyhow::anyhow!("database url without host"))?;
    tokio::net::lookup_host(host_port)
        .await?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{host_port} does not resolve"))
}
