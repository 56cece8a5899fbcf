//! Weighted fair share in the process worker (issue 38): one tenant's burst does not starve the
//! others; each busy tenant gets its weight's share of the claims; processes without a key are
//! claimed too. Control: the same backlog without a fair share runs oldest first.

use processes::{
    Definition, Done, FairShare, LocalStep, Registry, Step, StepContext, StepFuture, WorkerConfig,
};
use sqlx::{PgConnection, PgPool};
use std::collections::HashMap;
use std::time::Duration;
use system_tests::TestDb;
use system_tests::workers::InProcessWorker;

/// Records the order in which processes ran, with their tenant.
struct Record;

impl LocalStep for Record {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            let tenant = ctx.input.get("tenant").and_then(|v| v.as_str());
            sqlx::query("INSERT INTO fair_log (process_id, tenant) VALUES ($1, $2)")
                .bind(ctx.process_id)
                .bind(tenant)
                .execute(&mut *tx)
                .await?;
            // Slow enough that the backlog is the bottleneck, not the claims.
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok(Done::new(format!("ran:{}", ctx.process_id)))
        })
    }
}

fn keyed() -> Definition {
    Definition::new("fair_job", 1)
        .fair_key("tenant")
        .step(Step::local("record", Record))
}

fn unkeyed() -> Definition {
    Definition::new("plain_job", 1).step(Step::local("record", Record))
}

/// `flood` processes of tenant "flood" first (the oldest), then `others` each of "b" and "c",
/// and `plain` of a definition without a key.
async fn backlog(pool: &PgPool, flood: usize, others: usize, plain: usize) {
    sqlx::query(
        "CREATE TABLE fair_log (seq bigserial PRIMARY KEY, process_id uuid NOT NULL, tenant text)",
    )
    .execute(pool)
    .await
    .unwrap();
    let (k, u) = (keyed(), unkeyed());
    let mut tx = pool.begin().await.unwrap();
    for i in 0..flood {
        let input = serde_json::json!({ "tenant": "flood" });
        processes::start(&mut *tx, &k, &format!("flood-{i}"), &input)
            .await
            .unwrap();
    }
    // The burst is older: its own transaction (next_run_at is the transaction's start).
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    for i in 0..others {
        for t in ["b", "c"] {
            let input = serde_json::json!({ "tenant": t });
            processes::start(&mut *tx, &k, &format!("{t}-{i}"), &input)
                .await
                .unwrap();
        }
    }
    for i in 0..plain {
        processes::start(&mut *tx, &u, &format!("plain-{i}"), &serde_json::json!({}))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

fn worker(db: &TestDb, share: Option<FairShare>) -> InProcessWorker {
    let mut config = WorkerConfig::new(db.pool.clone(), Default::default(), "fair-worker");
    config.lease = Duration::from_secs(5);
    config.heartbeat = Duration::from_secs(1);
    config.poll_interval = Duration::from_millis(50);
    config.concurrency = 2;
    config.claim_batch = 2;
    config.fair_share = share;
    let registry = Registry::new()
        .with(keyed())
        .unwrap()
        .with(unkeyed())
        .unwrap();
    InProcessWorker::start_with(config, registry)
}

async fn ran(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM fair_log")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Who ran among the first `n` processes, by tenant ("" for none).
async fn first(pool: &PgPool, n: i64) -> HashMap<String, i64> {
    let rows: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT tenant, count(*) FROM (SELECT tenant FROM fair_log ORDER BY seq LIMIT $1) f GROUP BY 1",
    )
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(t, c)| (t.unwrap_or_default(), c))
        .collect()
}

async fn run_until(pool: &PgPool, n: i64) {
    let p = pool.clone();
    system_tests::wait_until(
        &format!("{n} processes ran"),
        Duration::from_secs(120),
        || {
            let p = p.clone();
            async move { (ran(&p).await >= n).then_some(()) }
        },
    )
    .await;
}

#[tokio::test]
async fn without_a_fair_share_a_burst_runs_first_oldest_first() {
    let db = TestDb::new().await;
    backlog(&db.pool, 200, 20, 0).await;
    let w = worker(&db, None);
    run_until(&db.pool, 60).await;
    w.stop().await;
    let got = first(&db.pool, 60).await;
    assert_eq!(
        got.get("flood"),
        Some(&60),
        "oldest first: the burst holds every turn, the others starve: {got:?}"
    );
}

#[tokio::test]
async fn a_tenants_burst_does_not_starve_the_others_and_each_gets_its_weight() {
    let db = TestDb::new().await;
    backlog(&db.pool, 300, 60, 0).await;
    // b has twice the weight of the flooding tenant and of c: b 1/2, flood 1/4, c 1/4.
    let share = FairShare::new().weight("b", 2);
    let w = worker(&db, Some(share));
    run_until(&db.pool, 80).await;
    w.stop().await;
    let got = first(&db.pool, 80).await;
    let (b, c, flood) = (got["b"], got["c"], got["flood"]);
    assert!(
        (32..=48).contains(&b),
        "b (weight 2) should get ~40 of 80: {got:?}"
    );
    assert!(
        (14..=26).contains(&c),
        "c (weight 1) should get ~20 of 80: {got:?}"
    );
    assert!(
        (14..=26).contains(&flood),
        "the flood (weight 1) ~20 of 80: {got:?}"
    );
}

#[tokio::test]
async fn processes_without_a_key_get_a_share_and_every_process_runs_once() {
    let db = TestDb::new().await;
    backlog(&db.pool, 100, 10, 10).await;
    let w = worker(&db, Some(FairShare::new()));
    run_until(&db.pool, 130).await;
    // Nothing more than once, nothing left behind.
    tokio::time::sleep(Duration::from_millis(500)).await;
    w.stop().await;
    let (total, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT process_id) FROM fair_log")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((total, distinct), (130, 130));
    let got = first(&db.pool, 40).await;
    assert!(
        got.get("").copied().unwrap_or(0) >= 5,
        "the processes without a key are one group with its share: {got:?}"
    );
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.processes WHERE status <> 'succeeded'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, 0);
}
