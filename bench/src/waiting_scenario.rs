//! `processes-waiting`: what processes parked at a wait step cost (issue 25: "100,000 waiting
//! processes cost nothing but rows, measured"), and how long a signal takes to move one on.
//!
//! One worker (the default configuration) first idles over empty tables (the baseline), then
//! `n` processes reach a wait step (correlated by `bench-wait:<i>`, deadline a day away) and park;
//! the worker idles again over them. Reported: the rows' bytes per waiting process, the worker's
//! and PostgreSQL's CPU while idle against the baseline, and, for 1,000 of them woken by
//! `processes::signal` in one transaction, the time from the signal's commit to each process's
//! next step done (from the database's timestamps).

use crate::env::{BenchEnv, CpuSnapshot};
use crate::process_scenario::Noop;
use crate::report::Line;
use hdrhistogram::Histogram;
use processes::{
    Definition, Registry, Remote, Step, StepContext, StepError, WaitStep, Worker, WorkerConfig,
};
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

struct Key;

impl WaitStep for Key {
    fn key(&self, ctx: &StepContext) -> Result<String, StepError> {
        Ok(format!("bench-wait:{}", ctx.input["i"]))
    }
}

fn definition() -> Definition {
    Definition::new("bench_wait", 1)
        .step(Step::wait(
            "await",
            Remote::Neither,
            Duration::from_secs(86_400),
            Key,
        ))
        .step(Step::local("after", Noop))
}

/// The CPU time this process (the bench, where the worker runs) has used, in ms.
fn own_cpu_ms() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0.0;
    };
    let rest: Vec<&str> = stat[close + 2..].split(' ').collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| rest.get(*i).and_then(|v| v.parse::<u64>().ok()))
        .sum();
    ticks as f64 * 10.0
}

/// The worker's and PostgreSQL's CPU (ms per second) over `window` of idling.
async fn idle_cpu(window: Duration) -> (f64, f64) {
    let (before, own) = (CpuSnapshot::take(), own_cpu_ms());
    tokio::time::sleep(window).await;
    let (after, own_after) = (CpuSnapshot::take(), own_cpu_ms());
    let secs = window.as_secs_f64();
    let pg = after.group_ms_since(&before, "postgres");
    ((own_after - own) / secs, pg / secs)
}

async fn waiting(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM outbox.process_steps WHERE wait_key LIKE 'bench-wait:%' AND status = 'running'",
    )
    .fetch_one(pool)
    .await?)
}

async fn bytes(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT sum(pg_total_relation_size(c))::bigint FROM unnest(ARRAY['outbox.processes', 'outbox.process_steps', 'outbox.process_history', 'outbox.process_transitions']::regclass[]) c",
    )
    .fetch_one(pool)
    .await?)
}

/// Signals the keys of `range` in one transaction; returns, per woken process, the time from the
/// commit to its next step done (µs, database clock).
async fn wake(
    pool: &PgPool,
    schema: &Schema,
    range: std::ops::Range<u64>,
) -> anyhow::Result<Histogram<u64>> {
    let keys: Vec<String> = range.clone().map(|j| format!("w{j}")).collect();
    let mut tx = pool.begin().await?;
    for j in range {
        processes::signal(
            &mut tx,
            schema,
            &format!("bench-wait:{j}"),
            &serde_json::json!({"ok": true}),
            "bench",
        )
        .await?;
    }
    let signalled_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&mut *tx)
            .await?;
    tx.commit().await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    let done = loop {
        let done: Vec<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
            "SELECT s.finished_at FROM outbox.process_steps s JOIN outbox.processes p ON p.id = s.process_id \
             WHERE p.kind = 'bench_wait' AND p.business_key = ANY($1) AND s.name = 'after' AND s.status = 'succeeded'",
        )
        .bind(&keys)
        .fetch_all(pool)
        .await?;
        if done.len() >= keys.len() {
            break done;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} of {} woken processes moved on in 300 s",
            done.len(),
            keys.len()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let mut h = Histogram::<u64>::new(3)?;
    for t in &done {
        h.record((*t - signalled_at).num_microseconds().unwrap_or(0).max(0) as u64)?;
    }
    Ok(h)
}

pub async fn processes_waiting(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(100_000, 200);
    let woken = (n - 1).min(1000);
    let window = env.secs(20.0, 2.0);
    let pool = plumbing::db::connect(&env.db_url, 12, "bench waiting worker").await?;
    let stop = CancellationToken::new();
    let config = WorkerConfig::new(pool.clone(), Schema::default(), "bench-wait");
    let registry = Registry::new().with(definition())?;
    let s = stop.clone();
    let worker = tokio::spawn(async move { Worker::run(config, registry, s).await });

    tokio::time::sleep(Duration::from_secs(1)).await;
    let empty_bytes = bytes(&env.pool).await?;
    let (base_worker, base_pg) = idle_cpu(window).await;

    // n processes, started in transactions of 1,000; the worker parks each at its wait.
    let def = definition();
    let schema = Schema::default();
    let started = Instant::now();
    let mut i = 0u64;
    while i < n {
        let mut tx = env.pool.begin().await?;
        for j in i..(i + 1000).min(n) {
            processes::start_in(
                &mut tx,
                &schema,
                &def,
                &format!("w{j}"),
                &serde_json::json!({ "i": j }),
            )
            .await?;
        }
        tx.commit().await?;
        i = (i + 1000).min(n);
    }
    let deadline = Instant::now() + Duration::from_secs(1800);
    while (waiting(&env.pool).await? as u64) < n {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the processes did not all park in 30 min"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let parked_in = started.elapsed();
    sqlx::query("VACUUM ANALYZE outbox.processes, outbox.process_steps")
        .execute(&env.pool)
        .await?;
    let per_process = (bytes(&env.pool).await? - empty_bytes) as f64 / n as f64;
    let (idle_worker, idle_pg) = idle_cpu(window).await;

    // One woken alone (the latency of one webhook), then `woken` more in one transaction.
    let one = wake(&env.pool, &schema, 0..1).await?;
    let h = wake(&env.pool, &schema, 1..woken + 1).await?;
    stop.cancel();
    let _ = worker.await;
    pool.close().await;

    Ok(vec![
        Line::new("processes waiting: bytes per waiting process", per_process, "bytes").note(format!(
            "{n} processes parked at a wait step (in {:.1} s): processes, process_steps, process_history and process_transitions with their indexes, after VACUUM, minus the empty tables",
            parked_in.as_secs_f64()
        )),
        Line::new("processes waiting: worker CPU while idle", idle_worker, "ms/s")
            .vs_ceiling(base_worker.max(0.01), None)
            .note(format!(
                "one worker, default settings, {:.0} s idle over {n} waiting processes; ceiling = the same worker idle over empty tables; PostgreSQL {idle_pg:.1} ms/s against {base_pg:.1} ms/s",
                window.as_secs_f64()
            )),
        Line::new("processes waiting: signal to next step, one process", one.max() as f64 / 1000.0, "ms")
            .note("one waiting process woken by processes::signal (as a webhook handler does); from its commit to the next step succeeded (database clock)"),
        Line::new("processes waiting: signal to next step, p99", h.value_at_quantile(0.99) as f64 / 1000.0, "ms")
            .note(format!(
                "{woken} processes woken by processes::signal in one transaction; from its commit to the next step succeeded (database clock): p50 {:.1} ms, max {:.1} ms",
                h.value_at_quantile(0.5) as f64 / 1000.0,
                h.max() as f64 / 1000.0
            )),
    ])
}
