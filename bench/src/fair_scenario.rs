//! `fair-share`: the share each of three tenants gets when one floods, against its weight
//! (issue 38), in the process worker and in the consumer, each against the same traffic without
//! a fair share in the same run.
//!
//! Traffic: tenant `a` floods (3,000 at scale 1) before `b` (weight 2) and `c` (weight 1) each
//! start 600; all three are then busy. Reported: each tenant's share of the first 800 done,
//! against its weight's share (b 50%, a and c 25% each), and the largest gap. Without a fair
//! share the flood, being first, takes them all.

use crate::consumer_scenario::publish_tenant_events;
use crate::env::BenchEnv;
use crate::report::Line;
use consumer::fair::FairShare as ConsumerShare;
use consumer::{Config, Consumer, Envelope, Handler, HandlerError, Handlers};
use processes::{
    Definition, Done, FairShare, LocalStep, Registry, Step, StepContext, StepFuture, Worker,
    WorkerConfig,
};
use shared::schema::Schema;
use sqlx::PgConnection;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The weights' shares: b 2 of 4, a and c 1 of 4.
const WANT: [(&str, f64); 3] = [("a", 0.25), ("b", 0.5), ("c", 0.25)];
/// How long a process step or a handler takes: the work is the bottleneck, not the claims.
const WORK: Duration = Duration::from_millis(2);

struct Work;

impl LocalStep for Work {
    fn run<'a>(&'a self, _: &'a StepContext, _: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            tokio::time::sleep(WORK).await;
            Ok(Done::new("done"))
        })
    }
}

/// Shares of the first `first` done, by tenant.
fn shares(order: &[String], first: usize) -> HashMap<String, f64> {
    let mut n: HashMap<String, f64> = HashMap::new();
    let take = order.len().min(first);
    for t in &order[..take] {
        *n.entry(t.clone()).or_default() += 1.0;
    }
    n.values_mut().for_each(|v| *v /= take.max(1) as f64);
    n
}

fn lines(
    what: &str,
    fair: &HashMap<String, f64>,
    plain: &HashMap<String, f64>,
    first: usize,
) -> Vec<Line> {
    let get = |m: &HashMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(0.0) * 100.0;
    let gap = WANT
        .iter()
        .map(|(k, w)| (get(fair, k) - w * 100.0).abs())
        .fold(0.0, f64::max);
    let mut out = vec![
        Line::new(&format!("fair-share {what}, largest gap"), gap, "pp")
            .at_most(10.0)
            .note(format!(
                "of the first {first} done: a (flood, weight 1) {:.0}%, b (weight 2) {:.0}%, c (weight 1) {:.0}%, against 25/50/25; without a fair share a {:.0}%, b {:.0}%, c {:.0}%",
                get(fair, "a"), get(fair, "b"), get(fair, "c"),
                get(plain, "a"), get(plain, "b"), get(plain, "c")
            )),
    ];
    for (k, w) in WANT {
        out.push(
            Line::new(&format!("fair-share {what}, {k}"), get(fair, k), "%")
                .vs_ceiling(w * 100.0, None),
        );
    }
    out.push(Line::new(
        &format!("fair-share {what}, a without"),
        get(plain, "a"),
        "%",
    ));
    out
}

/// The order processes of kind `kind` succeeded in, by tenant.
async fn process_order(env: &BenchEnv, kind: &str) -> anyhow::Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT input->>'tenant' FROM outbox.processes WHERE kind = $1 AND status = 'succeeded' ORDER BY updated_at, id",
    )
    .bind(kind)
    .fetch_all(&env.pool)
    .await?)
}

async fn processes_run(
    env: &BenchEnv,
    fair: bool,
    flood: u64,
    each: u64,
    first: usize,
) -> anyhow::Result<Vec<String>> {
    let kind = if fair { "bench_fair" } else { "bench_unfair" };
    let def = Definition::new(kind, 1)
        .fair_key("tenant")
        .step(Step::local("work", Work));
    let start = |tenant: &'static str, n: u64| {
        let def = def.clone();
        async move {
            let mut tx = env.pool.begin().await?;
            for i in 0..n {
                processes::start_in(
                    &mut tx,
                    &Schema::default(),
                    &def,
                    &format!("{tenant}-{i}"),
                    &serde_json::json!({ "tenant": tenant }),
                )
                .await?;
            }
            tx.commit().await?;
            anyhow::Ok(())
        }
    };
    start("a", flood).await?;
    start("b", each).await?;
    start("c", each).await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&env.db_url)
        .await?;
    let mut config = WorkerConfig::new(pool.clone(), Schema::default(), format!("bench-{kind}"));
    config.concurrency = 8;
    config.claim_batch = 8;
    config.fair_share = fair.then(|| FairShare::new().weight("b", 2));
    let stop = CancellationToken::new();
    let s = stop.clone();
    let registry = Registry::new().with(def.clone())?;
    let handle = tokio::spawn(async move { Worker::run(config, registry, s).await });
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.processes WHERE kind = $1 AND status = 'succeeded'",
        )
        .bind(kind)
        .fetch_one(&env.pool)
        .await?;
        if done as usize >= first {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{kind}: {done} of {first} in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let _ = handle.await;
    pool.close().await;
    process_order(env, kind).await
}

/// Records the tenant of each message it handles, in order.
#[derive(Clone)]
struct Record(Arc<Mutex<Vec<String>>>);

impl Handler for Record {
    async fn handle(&self, _: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        tokio::time::sleep(WORK).await;
        let t = msg
            .headers
            .get("tenant")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(t.to_string());
        Ok(())
    }
}

async fn consumer_run(
    env: &BenchEnv,
    fair: bool,
    flood: u64,
    each: u64,
    first: usize,
) -> anyhow::Result<Vec<String>> {
    let name = format!(
        "{}-{}",
        env.exchange.replace('.', "-"),
        if fair { "fair" } else { "unfair" }
    );
    let key = if fair {
        "fair.charged"
    } else {
        "unfair.charged"
    };
    let share = ConsumerShare::by_header("tenant").lanes(4).weight("b", 2);
    // `a` and `c` in different hashed lanes: `c` is the first of c, c1, c2, ... that is.
    let c = (0..)
        .map(|i| {
            if i == 0 {
                "c".to_string()
            } else {
                format!("c{i}")
            }
        })
        .find(|c| share.lane_of(&name, c) != share.lane_of(&name, "a"))
        .unwrap_or_else(|| "c".into());
    let mut config = Config::new(&name, &env.amqp_url, &env.exchange);
    config.bindings = vec![key.to_string()];
    // The same number of handling workers either way: 4 hashed lanes and b's 2.
    config.workers = if fair { 1 } else { 6 };
    config.fair_share = fair.then(|| share.clone());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(config.pool_size())
        .connect(&env.db_url)
        .await?;
    let order = Arc::new(Mutex::new(Vec::new()));
    let handlers = Handlers::new().on(key, Record(order.clone()));
    let consumer = Consumer::new(config, pool.clone(), handlers)?;
    let topology = consumer.topology().clone();
    topology
        .declare(&env.conn, &env.exchange, consumer.bindings())
        .await?;
    publish_tenant_events(env, key, "a", flood).await?;
    publish_tenant_events(env, key, "b", each).await?;
    publish_tenant_events(env, key, &c, each).await?;
    let stop = CancellationToken::new();
    let handle = tokio::spawn(consumer.run(stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(300);
    while order.lock().unwrap_or_else(|e| e.into_inner()).len() < first {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{name}: fewer than {first} handled in 300 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    let got = order.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Ok(got
        .into_iter()
        .map(|t| if t == c { "c".into() } else { t })
        .collect())
}

pub async fn fair_share(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let (flood, each) = (env.n(3000, 600), env.n(600, 120));
    let first = (each as usize * 4 / 3).max(100);
    let fair = processes_run(env, true, flood, each, first).await?;
    let plain = processes_run(env, false, flood, each, first).await?;
    let mut out = lines(
        "processes",
        &shares(&fair, first),
        &shares(&plain, first),
        first,
    );
    let fair = consumer_run(env, true, flood, each, first).await?;
    let plain = consumer_run(env, false, flood, each, first).await?;
    out.extend(lines(
        "consumer",
        &shares(&fair, first),
        &shares(&plain, first),
        first,
    ));
    Ok(out)
}
