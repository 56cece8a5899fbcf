//! `dependency-outage`: a remote that is down (issue 38), and what the dependency's circuit
//! costs when it is up.
//!
//! One worker runs three kinds of a one-step process whose external step calls an in-process
//! remote (a counter and a switch, so every call is counted and nothing else is measured), side
//! by side in the same outage:
//! - **circuit**: the step names the remote as a dependency (`Step::needs`, default policy,
//!   resume rate 50/s) and answers "unavailable" while it is down;
//! - **no circuit**: the same answer, no dependency (each step's own backoff, no attempt spent);
//! - **before**: the classification before issue 38, a transient error, with the example
//!   worker's old policy (10 attempts, 200 ms doubling to 10 s): what the issue measured.
//!
//! Processes arrive at 20 a second for each kind while the remote is down (60 s at scale 1, or
//! `BENCH_OUTAGE_SECS`), then it comes back. Reported: the calls a second each kind made to the
//! remote while it was down, the processes each failed, and for the circuit the time from the
//! recovery until every waiting process succeeded and the rate they resumed at (against the
//! resume rate). Then, with the remote up, the drain rate of a backlog with and without the
//! dependency, in the same run: what the breaker costs on the happy path.

use crate::env::BenchEnv;
use crate::report::Line;
use crate::scenarios::median;
use processes::{
    Definition, Done, ExternalStep, Registry, Remote, RetryPolicy, Step, StepContext, StepError,
    StepFuture, Worker, WorkerConfig,
};
use shared::schema::Schema;
use sqlx::PgPool;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The remote: down or up, and the calls it got.
#[derive(Default)]
struct FakeRemote {
    down: AtomicBool,
    calls: AtomicU64,
}

/// The step: calls the remote; while it is down, answers "unavailable", or (the classification
/// before issue 38) a transient error.
struct Call {
    remote: Arc<FakeRemote>,
    transient: bool,
}

impl ExternalStep for Call {
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done> {
        Box::pin(async move {
            self.remote.calls.fetch_add(1, Ordering::Relaxed);
            if self.remote.down.load(Ordering::Relaxed) {
                return Err(if self.transient {
                    StepError::transient("503 Service Unavailable")
                } else {
                    StepError::unavailable("503 Service Unavailable")
                        .retry_after(Some(Duration::from_secs(1)))
                });
            }
            Ok(Done::new(format!("ref-{}", ctx.business_key)))
        })
    }
}

struct Kind {
    name: &'static str,
    remote: Arc<FakeRemote>,
    definition: Definition,
}

fn kind(name: &'static str, dependency: Option<breaker::Dependency>, transient: bool) -> Kind {
    let remote = Arc::new(FakeRemote::default());
    let retry = if transient {
        RetryPolicy::default()
            .max_attempts(10)
            .initial(Duration::from_millis(200))
            .max_delay(Duration::from_secs(10))
    } else {
        RetryPolicy::default()
    };
    let step = Step::external(
        "call",
        Remote::HonoursKey,
        Call {
            remote: remote.clone(),
            transient,
        },
    )
    .retry(retry)
    .timeout(Duration::from_secs(5));
    let step = match dependency {
        Some(d) => step.needs(d),
        None => step,
    };
    Kind {
        name,
        remote,
        definition: Definition::new(name, 1).step(step),
    }
}

async fn count(pool: &PgPool, kind: &str, status: &str) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox.processes WHERE kind = $1 AND status = $2")
            .bind(kind)
            .bind(status)
            .fetch_one(pool)
            .await?,
    )
}

fn worker(
    pool: &PgPool,
    registry: Registry,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let mut config = WorkerConfig::new(pool.clone(), Schema::default(), "bench-outage");
    config.concurrency = 64;
    config.claim_batch = 64;
    let stop = stop.clone();
    tokio::spawn(async move {
        if let Err(e) = Worker::run(config, registry, stop).await {
            eprintln!("bench worker: {e}");
        }
    })
}

async fn worker_pool(env: &BenchEnv) -> anyhow::Result<PgPool> {
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(70)
        .connect(&env.db_url)
        .await?)
}

/// Starts one process of each kind every 50 ms for `d`.
async fn arrive(pool: &PgPool, kinds: &[&Kind], d: Duration, from: &mut u64) -> anyhow::Result<()> {
    let start = Instant::now();
    while start.elapsed() < d {
        for k in kinds {
            processes::start(
                pool,
                &k.definition,
                &format!("o{from}"),
                &serde_json::json!({}),
            )
            .await?;
        }
        *from += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

pub async fn dependency_outage(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let resume = 50;
    let dep = breaker::Dependency::new(
        "bench-remote",
        breaker::Policy::default().resume_per_second(resume),
    )?;
    let circuit = kind("bench_circuit", Some(dep), false);
    let plain = kind("bench_no_circuit", None, false);
    let before = kind("bench_before", None, true);
    let kinds = [&circuit, &plain, &before];
    let registry = kinds
        .iter()
        .try_fold(Registry::new(), |r, k| r.with(k.definition.clone()))?;
    let pool = worker_pool(env).await?;
    let stop = CancellationToken::new();
    let handle = worker(&pool, registry, &stop);

    // BENCH_OUTAGE_SECS sets the outage's length outright (1200: the twenty-minute outage).
    let outage = std::env::var("BENCH_OUTAGE_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map(Duration::from_secs)
        .unwrap_or_else(|| env.secs(60.0, 10.0));
    for k in &kinds {
        k.remote.down.store(true, Ordering::Relaxed);
    }
    let mut n = 0;
    arrive(&env.pool, &kinds, outage, &mut n).await?;
    let rates: Vec<f64> = kinds
        .iter()
        .map(|k| k.remote.calls.load(Ordering::Relaxed) as f64 / outage.as_secs_f64())
        .collect();
    let recovered = Instant::now();
    for k in &kinds {
        k.remote.down.store(false, Ordering::Relaxed);
    }
    let expected = n as i64;
    let mut first_done: Option<Duration> = None;
    let deadline = recovered + Duration::from_secs(1800);
    let took = loop {
        let done = count(&env.pool, circuit.name, "succeeded").await?;
        if done > 0 && first_done.is_none() {
            first_done = Some(recovered.elapsed());
        }
        if done == expected {
            break recovered.elapsed();
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {done} of {expected} processes succeeded 30 minutes after the recovery"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Let the other kinds settle too (their backoffs may be up to 100 s).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut failed = Vec::new();
    for k in &kinds {
        failed.push(
            count(&env.pool, k.name, "failed").await?
                + count(&env.pool, k.name, "compensated").await?,
        );
    }
    stop.cancel();
    let _ = handle.await;
    pool.close().await;

    let resumed_rate = expected as f64
        / (took - first_done.unwrap_or_default())
            .as_secs_f64()
            .max(0.001);
    let mut lines = vec![
        Line::new("dependency-outage calls, circuit", rates[0], "calls/s")
            .at_most(1.0)
            .note(format!(
                "{expected} processes of each kind arrived during a {:.0} s outage; calls a second to the down remote: circuit {:.2}, no circuit {:.2} (own backoff, no attempt spent), before issue 38 {:.2} (transient, 10 attempts 200 ms..10 s)",
                outage.as_secs_f64(),
                rates[0],
                rates[1],
                rates[2]
            )),
        Line::new("dependency-outage calls, no circuit", rates[1], "calls/s"),
        Line::new("dependency-outage calls, before", rates[2], "calls/s"),
        Line::new("dependency-outage failed, circuit", failed[0] as f64, "processes").at_most(0.0),
        Line::new("dependency-outage failed, no circuit", failed[1] as f64, "processes")
            .at_most(0.0),
        Line::new("dependency-outage failed, before", failed[2] as f64, "processes").note(
            "the classification before issue 38: an outage longer than the attempts' backoff fails the process",
        ),
        Line::new("dependency-outage recovery", took.as_secs_f64(), "s").note(format!(
            "from the recovery until all {expected} waiting processes (circuit) succeeded: the first after {:.1} s (the next probe), then {resumed_rate:.0}/s against a resume rate of {resume}/s",
            first_done.unwrap_or_default().as_secs_f64()
        )),
        Line::new("dependency-outage resume rate", resumed_rate, "proc/s")
            .vs_ceiling(f64::from(resume), None),
    ];
    lines.extend(happy_path(env).await?);
    lines.extend(consumer_happy_path(env).await?);
    Ok(lines)
}

/// Counts the messages it handles; does nothing else (so the runtime's cost shows).
#[derive(Clone)]
struct Count(Arc<AtomicU64>);

impl consumer::Handler for Count {
    async fn handle(
        &self,
        _: &mut sqlx::PgConnection,
        _: &consumer::Envelope,
    ) -> Result<(), consumer::HandlerError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The consumer's drain rate of a queue of messages with the handler's remote up, with and
/// without the handler naming it as a dependency (twice each, alternating; medians).
async fn consumer_happy_path(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(20_000, 1000);
    let dep = breaker::Dependency::new("bench-up-consumer", breaker::Policy::default())?;
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 0..2 {
        for needs in [true, false] {
            let name = format!(
                "{}-happy-{round}-{}",
                env.exchange.replace('.', "-"),
                if needs { "dep" } else { "plain" }
            );
            let key = format!("happy{round}{}.charged", u8::from(needs));
            let mut config = consumer::Config::new(&name, &env.amqp_url, &env.exchange);
            config.bindings = vec![key.clone()];
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(config.pool_size())
                .connect(&env.db_url)
                .await?;
            let done = Arc::new(AtomicU64::new(0));
            let handlers = if needs {
                consumer::Handlers::new().on_needing(key.clone(), dep.clone(), Count(done.clone()))
            } else {
                consumer::Handlers::new().on(key.clone(), Count(done.clone()))
            };
            let c = consumer::Consumer::new(config, pool.clone(), handlers)?;
            let topology = c.topology().clone();
            topology
                .declare(&env.conn, &env.exchange, c.bindings())
                .await?;
            crate::consumer_scenario::publish_tenant_events(env, &key, "t", n).await?;
            let stop = CancellationToken::new();
            let start = Instant::now();
            let handle = tokio::spawn(c.run(stop.clone()));
            while done.load(Ordering::Relaxed) < n {
                anyhow::ensure!(
                    start.elapsed() < Duration::from_secs(300),
                    "{name}: drain too slow"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let rate = n as f64 / start.elapsed().as_secs_f64();
            stop.cancel();
            let _ = handle.await;
            pool.close().await;
            for q in topology.queues() {
                env.delete_queue(&q).await;
            }
            if let Ok(ch) = env.conn.create_channel().await {
                for e in topology.exchanges() {
                    let _ = ch
                        .exchange_delete(e.as_str().into(), Default::default())
                        .await;
                }
            }
            if needs {
                with.push(rate)
            } else {
                without.push(rate)
            }
        }
    }
    let (with, without) = (median(with), median(without));
    Ok(vec![
        Line::new("dependency happy path, consumer", with, "msg/s")
            .vs_ceiling(without, Some(0.9))
            .note(format!(
                "{n} messages drained by a consumer (default settings) whose handler names its remote as a dependency (closed circuit: a cached read per call) against the same handler without it (the ceiling), medians of two"
            )),
    ])
}

/// The drain rate of a backlog of one-step processes with the remote up, with and without a
/// dependency (twice each, alternating; medians).
async fn happy_path(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(3000, 300);
    let dep = breaker::Dependency::new("bench-up", breaker::Policy::default())?;
    let mut with = Vec::new();
    let mut without = Vec::new();
    for round in 0..2 {
        for (i, needs) in [true, false].into_iter().enumerate() {
            let name: &'static str = match (needs, round) {
                (true, 0) => "bench_up_dep_0",
                (true, _) => "bench_up_dep_1",
                (false, 0) => "bench_up_plain_0",
                (false, _) => "bench_up_plain_1",
            };
            let k = kind(name, needs.then(|| dep.clone()), false);
            let mut tx = env.pool.begin().await?;
            for j in 0..n {
                processes::start_in(
                    &mut tx,
                    &Schema::default(),
                    &k.definition,
                    &format!("h{round}-{i}-{j}"),
                    &serde_json::json!({}),
                )
                .await?;
            }
            tx.commit().await?;
            let pool = worker_pool(env).await?;
            let stop = CancellationToken::new();
            let start = Instant::now();
            let handle = worker(&pool, Registry::new().with(k.definition.clone())?, &stop);
            loop {
                if count(&env.pool, name, "succeeded").await? == n as i64 {
                    break;
                }
                anyhow::ensure!(start.elapsed() < Duration::from_secs(300), "drain too slow");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let rate = n as f64 / start.elapsed().as_secs_f64();
            stop.cancel();
            let _ = handle.await;
            pool.close().await;
            if needs {
                with.push(rate)
            } else {
                without.push(rate)
            }
        }
    }
    let (with, without) = (median(with), median(without));
    Ok(vec![
        Line::new("dependency happy path, processes", with, "proc/s")
            .vs_ceiling(without, Some(0.9))
            .note(format!(
                "{n} one-step processes drained by one worker with the remote named as a dependency (closed circuit: a cached read, no write) against the same without it (the ceiling), medians of two"
            )),
    ])
}
