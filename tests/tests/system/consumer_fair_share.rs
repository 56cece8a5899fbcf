//! Weighted fair share in the consumer (issue 38): one tenant's burst, published before the
//! others' messages, does not hold them up behind it. The consumer sorts its queue into lanes by
//! the `tenant` header and works the lanes side by side; a tenant with weight 2 has a lane with
//! two workers. Control: the same traffic without a fair share is applied in queue order.

use consumer::fair::FairShare;
use consumer::topology::Topology;
use consumer::{Config, Handler, HandlerError, Handlers};
use serde_json::json;
use shared::{Envelope, NewMessage};
use sqlx::PgConnection;
use std::collections::HashMap;
use std::time::Duration;
use system_tests::consumers::{RunningConsumer, track_consumer};
use system_tests::relays::{InProcess, test_options};
use system_tests::{TestBroker, TestDb, amqp_url, unique, wait_no_pending, wait_until};

/// Records each message's tenant, slowly enough that the burst is a backlog.
struct Record;

impl Handler for Record {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        tokio::time::sleep(Duration::from_millis(10)).await;
        sqlx::query("INSERT INTO fair_applied (tenant, message_id) VALUES ($1, $2)")
            .bind(msg.headers.get("tenant").and_then(|v| v.as_str()))
            .bind(msg.message_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// 400 messages of "flood" in one transaction, then 40 each of "b" and `c`: applied by a
/// consumer with `share`. Returns the tenants in the order their messages were applied, and
/// checks every message was applied once.
async fn burst(share: Option<FairShare>, c: &str) -> Vec<String> {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE TABLE fair_applied (position bigserial PRIMARY KEY, tenant text, message_id uuid)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("fair");
    let name = unique("fair");
    let retry_delays = vec![Duration::from_secs(1)];
    track_consumer(&broker, &name, &retry_delays, None);
    if let Some(s) = &share {
        for lane in s.all_lanes(&name) {
            broker.track_queue(&lane.queue);
        }
    }
    let message = |tenant: &str, n: usize| {
        NewMessage::new(
            "account",
            format!("{tenant}-{n}"),
            "account.charged",
            json!({ "n": n }),
        )
        .with_header("tenant", tenant)
    };
    let flood: Vec<NewMessage> = (0..400).map(|n| message("flood", n)).collect();
    shared::outbox::enqueue_many(&db.pool, &flood)
        .await
        .unwrap();
    let others: Vec<NewMessage> = (0..40)
        .flat_map(|n| [message("b", n), message(c, n)])
        .collect();
    shared::outbox::enqueue_many(&db.pool, &others)
        .await
        .unwrap();

    let mut config = Config::new(&name, amqp_url(), &exchange);
    config.retry_delays = retry_delays;
    config.workers = 1;
    config.batch_size = 20;
    config.prefetch = 40;
    config.fair_share = share;
    let pool = plumbing::db::connect(&db.url, config.pool_size(), "fair-consumer")
        .await
        .unwrap();
    // The queue fills before the consumer starts: the burst is in front. Its topology is declared
    // first, or what the relay publishes meanwhile is unrouted.
    let conn = broker.connect().await;
    Topology::new(&name, &config.retry_delays)
        .declare(&conn, &exchange, &["account.#".into()])
        .await
        .unwrap();
    let relay = InProcess::on(&db, &exchange, test_options()).await;
    wait_no_pending(&db.pool, Duration::from_secs(60)).await;
    relay.stop().await;
    let consumer = RunningConsumer::start(
        config.clone(),
        pool.clone(),
        Handlers::new().on("account.#", Record),
    )
    .await;
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM fair_applied")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    wait_until("all applied", Duration::from_secs(180), || async {
        (count().await >= 480).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (total, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM fair_applied")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((total, distinct), (480, 480), "every message applied once");
    let stats = consumer.stats.snapshot();
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    consumer.stop().await;
    let _ = conn.close(200, "done".into()).await;
    let order: Vec<String> =
        sqlx::query_scalar("SELECT tenant FROM fair_applied ORDER BY position")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    eprintln!("applied in order: {order:?}; {stats:?}");
    order
}

/// Where (0-based) the `n`th message of `tenant` was applied.
fn nth(order: &[String], tenant: &str, n: usize) -> usize {
    order
        .iter()
        .enumerate()
        .filter(|(_, t)| t.as_str() == tenant)
        .nth(n - 1)
        .map(|(i, _)| i)
        .unwrap()
}

/// Who was applied among the `len` messages from position `from` on.
fn window(order: &[String], from: usize, len: usize) -> HashMap<String, i64> {
    let mut m = HashMap::new();
    for t in order.iter().skip(from).take(len) {
        *m.entry(t.clone()).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_fair_share_a_burst_in_front_is_applied_first() {
    let order = burst(None, "c").await;
    assert!(
        nth(&order, "c", 10) >= 400,
        "queue order: c's messages wait behind the whole burst: {:?}",
        window(&order, 0, 80)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_in_front_does_not_hold_up_the_others_and_weight_two_gets_two_lanes_workers() {
    let share = FairShare::by_header("tenant").lanes(4).weight("b", 2);
    // A tenant that does not share the burst's hashed lane.
    let c = (0..)
        .map(|i| format!("c{i}"))
        .find(|c| share.lane_of("x", c) != share.lane_of("x", "flood"))
        .unwrap();
    let order = burst(Some(share), &c).await;
    // The others are not held up behind the burst: c's tenth message long before the burst's end
    // (it would be after all 400 of it in queue order).
    let tenth = nth(&order, &c, 10);
    assert!(tenth < 200, "c's tenth message applied at {tenth}");
    // Once every lane has work, side by side: b's two workers, c's one and the burst's one, about
    // 30, 15 and 15 of 60.
    let from = nth(&order, &c, 1);
    let w = window(&order, from, 60);
    let (b, cw, flood) = (
        w.get("b").copied().unwrap_or(0),
        w.get(c.as_str()).copied().unwrap_or(0),
        w.get("flood").copied().unwrap_or(0),
    );
    assert!(b >= 22, "b (weight 2): {w:?}");
    assert!(cw >= 9, "c: {w:?}");
    assert!(flood <= 30, "the burst holds only its own lane: {w:?}");
    assert!(b > cw, "weight 2 over weight 1: {w:?}");
}
