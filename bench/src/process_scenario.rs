//! The `processes` scenario: a 3-step no-op process (local steps) run by several workers.
//!
//! Measures, in one run: the PostgreSQL commit ceiling (single-row autocommit INSERTs on as many
//! connections as the workers use), the drain rate of a backlog (processes/s and steps/s), the
//! start-to-succeeded latency at a steady 100 processes/s (from the database's own timestamps),
//! and the commits per step (from `pg_stat_database`). Round trips per step are counted from the
//! code path (see docs/processes.md), since pg_stat_statements is not loaded here.

use crate::env::BenchEnv;
use crate::report::Line;
use hdrhistogram::Histogram;
use processes::{
    Definition, Done, LocalStep, Registry, Step, StepContext, StepFuture, Worker, WorkerConfig,
};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const WORKERS: usize = 4;
const CONCURRENCY: usize = 16;

struct Noop;

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

async fn commits(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?)
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

struct Workers {
    stop: CancellationToken,
    handles: Vec<tokio::task::JoinHandle<()>>,
    pools: Vec<PgPool>,
}

async fn spawn_workers(env: &BenchEnv) -> anyhow::Result<Workers> {
    let stop = CancellationToken::new();
    let mut handles = Vec::new();
    let mut pools = Vec::new();
    for w in 0..WORKERS {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(CONCURRENCY as u32 + 2)
            .connect(&env.db_url)
            .await?;
        let mut config = WorkerConfig::new(pool.clone(), Schema::default(), format!("bench-{w}"));
        config.concurrency = CONCURRENCY;
        config.claim_batch = CONCURRENCY as i64;
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

pub async fn run(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let mut lines = Vec::new();
    env.settle().await?;
    let ceiling = commit_ceiling(env, WORKERS * CONCURRENCY, env.secs(5.0, 1.0)).await?;
    lines.push(
        Line::new("processes commit ceiling", ceiling, "commits/s").note(format!(
            "single-row autocommit INSERTs on {} connections",
            WORKERS * CONCURRENCY
        )),
    );

    // Drain: a backlog started before the workers, then timed until the last one succeeded.
    let n = env.n(20_000, 500);
    start_many(&env.pool, 0, n).await?;
    sqlx::query("ANALYZE outbox.processes")
        .execute(&env.pool)
        .await?;
    sqlx::query("ANALYZE outbox.process_steps")
        .execute(&env.pool)
        .await?;
    env.settle().await?;
    let commits_before = commits(&env.pool).await?;
    let started = Instant::now();
    let workers = spawn_workers(env).await?;
    loop {
        if succeeded(&env.pool).await? >= n as i64 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "drain did not finish in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed().as_secs_f64();
    let commits_after = commits(&env.pool).await?;
    let rate = n as f64 / took;
    let steps = 3.0 * n as f64;
    // Every poll above is one commit too; they are few (one per 20 ms).
    let polls = (took / 0.02).ceil();
    let per_step = ((commits_after - commits_before) as f64 - polls).max(0.0) / steps;
    lines.push(
        Line::new("processes drain", rate, "processes/s")
            .at_least(1000.0)
            .note(format!(
                "{n} 3-step no-op processes, {WORKERS} workers x {CONCURRENCY}; {:.0} steps/s",
                steps / took
            )),
    );
    lines.push(
        Line::new("processes drain", rate / ceiling, "of commit ceiling")
            .note(format!("ceiling {ceiling:.0} commits/s")),
    );
    lines.push(Line::new("processes commits per step", per_step, "commits").note(
        "pg_stat_database xact_commit during the drain (claims included) / steps; round trips per local step: 4 (BEGIN, fence, checkpoint, COMMIT), +1 on the last step (process update); +2 per process (claim share, step load)",
    ));

    // Latency at a steady 100 processes/s, with the workers idle between starts.
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
    loop {
        if succeeded(&env.pool).await? >= (n + total) as i64 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "latency run did not finish"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    workers.stop().await;
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
    Ok(lines)
}
