//! The relay behind PgBouncer in transaction pooling mode: Debian's PgBouncer (1.18, without
//! `max_prepared_statements`), started by the test with its own configuration and port in front of
//! the shared PostgreSQL's test database, with only two server connections for two relays so that
//! their transactions really share servers.

use serde_json::json;
use shared::NewMessage;
use std::collections::HashSet;
use std::time::Duration;
use system_tests::consumers::example_consumer_command;
use system_tests::pgbouncer::PgBouncer;
use system_tests::*;
use tokio::process::Child;

const LONG: Duration = Duration::from_secs(120);
const N: i64 = 3000;

fn spawn_relay(db_url: &str, direct_url: Option<&str>, exchange: &str) -> Child {
    let mut cmd = relays::relay_command(db_url, &amqp_url(), exchange, free_addr());
    cmd.args(["--lease-ms", "2000", "--confirm-timeout-ms", "800"])
        .args(["--poll-interval-ms", "200", "--stats-interval-ms", "200"])
        .args(["--retry-base-ms", "50", "--retry-max-ms", "200"])
        .env("DATABASE_POOLER", "transaction");
    if let Some(direct) = direct_url {
        cmd.env("DATABASE_DIRECT_URL", direct);
    }
    cmd.spawn().expect("spawn relay")
}

fn msgs(from: i64, to: i64) -> Vec<NewMessage> {
    spread("order", "order.created", "o-", 20, from..to)
}

struct Setup {
    db: TestDb,
    bouncer: PgBouncer,
    _broker: TestBroker,
    exchange: String,
    rx: tokio::sync::mpsc::UnboundedReceiver<Received>,
    _conn: lapin::Connection,
}

async fn setup() -> Setup {
    let db = TestDb::new().await;
    let bouncer = PgBouncer::start(5432, "transaction", &["default_pool_size = 2"]);
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(true).await;
    let queue = broker.queue("pgbouncer");
    let rx = collect_queue(&conn, &exchange, &queue, &["#"]).await;
    Setup {
        db,
        bouncer,
        _broker: broker,
        exchange,
        rx,
        _conn: conn,
    }
}

/// Every message id received exactly `n` distinct ones (duplicates allowed: at least once).
async fn receive_distinct(s: &mut Setup, n: usize) -> HashSet<String> {
    let mut ids = HashSet::new();
    let deadline = tokio::time::Instant::now() + LONG;
    while ids.len() < n {
        match tokio::time::timeout_at(deadline, s.rx.recv()).await {
            Ok(Some(r)) => {
                ids.insert(r.message_id);
            }
            Ok(None) => panic!("queue consumer ended"),
            Err(_) => panic!(
                "{} of {n} messages after {LONG:?}; PgBouncer log:\n{}",
                ids.len(),
                s.bouncer.log()
            ),
        }
    }
    ids
}

/// Connections to the test database, as the server sees them, whose last statement was a LISTEN.
async fn listening(s: &Setup, application_name: Option<&str>) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND query ILIKE 'LISTEN%' \
         AND ($2::text IS NULL OR application_name = $2)",
    )
    .bind(&s.db.name)
    .bind(application_name)
    .fetch_one(&s.db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_publish_everything_through_transaction_pooling_and_listen_on_the_direct_url() {
    let mut s = setup().await;
    enqueue(&s.db.pool, &msgs(0, N)).await;
    let url = s.bouncer.url(&s.db.name);
    let _a = spawn_relay(&url, Some(&s.db.url), &s.exchange);
    let _b = spawn_relay(&url, Some(&s.db.url), &s.exchange);
    assert_eq!(receive_distinct(&mut s, N as usize).await.len(), N as usize);
    // Each relay LISTENs on a direct connection of its own, not through PgBouncer.
    wait_until("both relays LISTEN on the direct URL", LONG, || async {
        (listening(&s, Some("outbox-relay-listen")).await == 2).then_some(())
    })
    .await;
    assert_eq!(listening(&s, None).await, 2, "no LISTEN anywhere else");
    enqueue(&s.db.pool, &msgs(N, N + 100)).await;
    assert_eq!(receive_distinct(&mut s, 100).await.len(), 100);
    wait_until("outbox drained", LONG, || async {
        (outbox_count(&s.db.pool, "pending").await == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_direct_url_the_relay_polls_through_transaction_pooling() {
    let mut s = setup().await;
    enqueue(&s.db.pool, &msgs(0, N)).await;
    let url = s.bouncer.url(&s.db.name);
    let _a = spawn_relay(&url, None, &s.exchange);
    let _b = spawn_relay(&url, None, &s.exchange);
    assert_eq!(receive_distinct(&mut s, N as usize).await.len(), N as usize);
    enqueue(&s.db.pool, &msgs(N, N + 100)).await;
    assert_eq!(receive_distinct(&mut s, 100).await.len(), 100);
    wait_until("outbox drained", LONG, || async {
        (outbox_count(&s.db.pool, "pending").await == 0).then_some(())
    })
    .await;
    assert_eq!(
        listening(&s, None).await,
        0,
        "no LISTEN through the transaction pooler"
    );
}

async fn enqueue(pool: &sqlx::PgPool, msgs: &[NewMessage]) {
    for chunk in msgs.chunks(500) {
        shared::outbox::enqueue_many(pool, chunk).await.unwrap();
    }
}

/// Producers, two relays and the ledger consumer, all on PgBouncer's two server connections in
/// transaction mode: producers enqueue with unnamed statements
/// (`Outbox::named_statements(false)`), the consumer runs its own statements and the ledger's
/// unnamed in one transaction per batch, migrations and LISTEN go over the direct URL. Every
/// event is applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_relays_and_a_consumer_all_through_transaction_pooling() {
    let s = setup().await;
    let bouncer_url = s.bouncer.url(&s.db.name);
    // The ledger's queue on the test's exchange, tracked for deletion with the rest.
    let name = unique("ledger");
    let topology = consumer::topology::Topology::new(
        &name,
        &[Duration::from_millis(100), Duration::from_millis(200)],
    );
    for q in topology.queues() {
        s._broker.track_queue(&q);
    }
    for e in topology.exchanges() {
        s._broker.track_exchange(&e);
    }
    let metrics = free_addr();
    let _ledger = example_consumer_command(
        "ledger",
        &name,
        &bouncer_url,
        &amqp_url(),
        &s.exchange,
        metrics,
    )
    .args(["--bind", "payment.captured"])
    .args(["--retry-delays", "100ms,200ms", "--workers", "2"])
    .env("DATABASE_POOLER", "transaction")
    .env("DATABASE_DIRECT_URL", &s.db.url)
    .spawn()
    .expect("spawn the ledger consumer");
    wait_http_ok("the ledger consumer is ready", metrics, "/readyz", LONG).await;
    let _a = spawn_relay(&bouncer_url, Some(&s.db.url), &s.exchange);
    let _b = spawn_relay(&bouncer_url, Some(&s.db.url), &s.exchange);

    // Producers through PgBouncer: 8 writers, 25 transactions each, one event per transaction.
    let producers = plumbing::db::connect_via(
        &bouncer_url,
        plumbing::db::Pooler::Transaction,
        8,
        "producer",
    )
    .await
    .unwrap();
    let outbox = shared::outbox::Outbox::default().named_statements(false);
    let writers = (0..8).map(|w| {
        let (pool, outbox) = (producers.clone(), outbox.clone());
        tokio::spawn(async move {
            for i in 0..25i64 {
                let n = w * 25 + i;
                let account = format!("acct-{}", n % 5);
                let mut tx = pool.begin().await.unwrap();
                outbox.lock_aggregate(&mut *tx, &account).await.unwrap();
                let event = NewMessage::new(
                    "payment",
                    account.clone(),
                    "payment.captured",
                    json!({"account": account, "amount": n + 1}),
                );
                outbox.enqueue(&mut *tx, &event).await.unwrap();
                tx.commit().await.unwrap();
            }
        })
    });
    for w in futures::future::join_all(writers).await {
        w.unwrap();
    }

    // Each account's balance is the sum of its amounts, each event applied once.
    let mut want = std::collections::BTreeMap::new();
    for n in 0..200i64 {
        let e = want
            .entry(format!("acct-{}", n % 5))
            .or_insert((0i64, 0i64));
        e.0 += n + 1;
        e.1 += 1;
    }
    let pool = s.db.pool.clone();
    let got = wait_until("the ledger applied all 200 events", LONG, || {
        let pool = pool.clone();
        async move {
            let rows: Vec<(String, i64, i64)> = sqlx::query_as(
                "SELECT account, balance, updates FROM demo.ledger_balances ORDER BY account",
            )
            .fetch_all(&pool)
            .await
            .ok()?;
            let total: i64 = rows.iter().map(|r| r.2).sum();
            (total >= 200).then_some(rows)
        }
    })
    .await;
    let got: std::collections::BTreeMap<String, (i64, i64)> =
        got.into_iter().map(|(a, b, u)| (a, (b, u))).collect();
    assert_eq!(got, want);
    // Once every row is confirmed and gone from the outbox (a row published twice included), the
    // ledger still holds each event once.
    wait_until("outbox drained", LONG, || async {
        (outbox_count(&s.db.pool, "pending").await == 0).then_some(())
    })
    .await;
    let updates: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(updates), 0)::bigint FROM demo.ledger_balances")
            .fetch_one(&s.db.pool)
            .await
            .unwrap();
    assert_eq!(updates, 200);
    assert_eq!(consumers::processed_rows(&s.db.pool, &name).await, 200);
}
