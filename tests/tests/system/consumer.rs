//! The consumer against real PostgreSQL and RabbitMQ: deduplication, crashes with messages in
//! flight, several instances and several consumers, poison messages, retries, dead letters and
//! replay, graceful shutdown, lost links, retention, and the whole chain with the relay.

use consumer::topology::Topology;
use consumer::{Config, Handler, HandlerError, Handlers};
use lapin::options::BasicPublishOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use serde_json::json;
use shared::{Envelope, NewMessage};
use sqlx::{PgConnection, PgPool};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use system_tests::consumers::{example_consumer_command, processed_rows};
use system_tests::fleet::metric;
use system_tests::relays::FAST_FLAGS;
use system_tests::*;
use tokio::process::Child;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const RETRY_DELAYS: [Duration; 2] = [Duration::from_millis(100), Duration::from_millis(200)];
const LONG: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A fresh exchange and consumer name, with every broker object the consumer will create tracked
/// for deletion.
fn names(broker: &TestBroker) -> (String, String) {
    let exchange = broker.outbox_exchange("outbox");
    let name = unique("cons");
    track_consumer(broker, &name);
    (exchange, name)
}

fn track_consumer(broker: &TestBroker, name: &str) {
    system_tests::consumers::track_consumer(broker, name, &RETRY_DELAYS, None);
}

fn test_config(name: &str, exchange: &str) -> Config {
    let mut c = Config::new(name, amqp_url(), exchange);
    c.retry_delays = RETRY_DELAYS.to_vec();
    c.max_attempts = 3;
    c.workers = 2;
    c.batch_size = 50;
    c.prefetch = 100;
    c
}

async fn consumer_pool(url: &str, config: &Config) -> PgPool {
    plumbing::db::connect(url, config.pool_size(), "consumer-test")
        .await
        .expect("consumer pool")
}

use system_tests::consumers::RunningConsumer as Running;

/// Publishes like the relay does (same properties and headers), with publisher confirms.
struct Publisher {
    _conn: Connection,
    ch: Channel,
    exchange: String,
}

impl Publisher {
    async fn new(broker: &TestBroker, exchange: &str) -> Self {
        let (conn, ch) = broker.outbox_publisher(exchange).await;
        Self {
            _conn: conn,
            ch,
            exchange: exchange.to_string(),
        }
    }

    async fn publish_all(&self, msgs: &[NewMessage]) {
        for m in msgs {
            self.send(
                &m.event_type,
                relay_properties(m),
                m.payload.to_string().as_bytes(),
            )
            .await;
        }
        self.confirm().await;
    }

    async fn publish(&self, m: &NewMessage) {
        self.publish_all(std::slice::from_ref(m)).await;
    }

    /// Anything, through the outbox exchange.
    async fn publish_raw(&self, routing_key: &str, props: BasicProperties, body: &[u8]) {
        self.send(routing_key, props, body).await;
        self.confirm().await;
    }

    /// Straight into a queue (default exchange).
    async fn to_queue(&self, queue: &str, props: BasicProperties, body: &[u8]) {
        self.ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap();
        self.confirm().await;
    }

    async fn send(&self, routing_key: &str, props: BasicProperties, body: &[u8]) {
        self.ch
            .basic_publish(
                self.exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap();
    }

    async fn confirm(&self) {
        let returned = self.ch.wait_for_confirms().await.unwrap();
        assert!(returned.is_empty());
    }
}

/// The properties and headers the relay sets (the message format contract).
fn relay_properties(m: &NewMessage) -> BasicProperties {
    let now = chrono::Utc::now();
    let mut headers = FieldTable::default();
    plumbing::amqp::json_to_headers(&m.headers, &mut headers).unwrap();
    let mut extra = serde_json::Map::new();
    extra.insert(
        plumbing::amqp::headers::AGGREGATE_TYPE.into(),
        json!(m.aggregate_type),
    );
    extra.insert(
        plumbing::amqp::headers::AGGREGATE_ID.into(),
        json!(m.aggregate_id),
    );
    extra.insert(
        plumbing::amqp::headers::CREATED_AT.into(),
        json!(now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
    );
    plumbing::amqp::json_to_headers(&extra, &mut headers).unwrap();
    BasicProperties::default()
        .with_message_id(m.id.to_string().into())
        .with_type(m.event_type.as_str().into())
        .with_content_type("application/json".into())
        .with_timestamp(now.timestamp() as u64)
        .with_delivery_mode(2)
        .with_headers(headers)
}

fn payment(account: &str, amount: i64) -> NewMessage {
    NewMessage::new(
        "account",
        account,
        "payment.captured",
        json!({"account": account, "amount": amount}),
    )
    .with_header(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )
}

/// `n` payments over `accounts` accounts, and the balances and update counts they must produce.
fn payments(n: usize, accounts: usize) -> (Vec<NewMessage>, BTreeMap<String, (i64, i64)>) {
    let mut expected: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let msgs = (0..n)
        .map(|i| {
            let account = format!("acct-{}", i % accounts);
            let amount = (i as i64 * 37) % 1000 - 300;
            let e = expected.entry(account.clone()).or_default();
            e.0 += amount;
            e.1 += 1;
            payment(&account, amount)
        })
        .collect();
    (msgs, expected)
}

/// Declares consumer `name`'s topology (queue bound to `payment.captured`) before any consumer
/// runs, so what is published next waits in its queue. Returns the connection it used.
async fn declared_before_start(broker: &TestBroker, exchange: &str, name: &str) -> Connection {
    let conn = broker.connect().await;
    Topology::new(name, &RETRY_DELAYS)
        .declare(&conn, exchange, &["payment.captured".into()])
        .await
        .unwrap();
    conn
}

/// Publishes [`payments`]`(n, accounts)` to `exchange`; returns the balances they must make.
async fn publish_payments(
    broker: &TestBroker,
    exchange: &str,
    n: usize,
    accounts: usize,
) -> BTreeMap<String, (i64, i64)> {
    let (msgs, expected) = payments(n, accounts);
    Publisher::new(broker, exchange)
        .await
        .publish_all(&msgs)
        .await;
    expected
}

async fn ledger(pool: &PgPool) -> BTreeMap<String, (i64, i64)> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT account, balance, updates FROM demo.ledger_balances ORDER BY account",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter().map(|(a, b, u)| (a, (b, u))).collect()
}

async fn total_updates(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT COALESCE(sum(updates), 0)::bigint FROM demo.ledger_balances")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Ready messages in a queue.
async fn queue_depth(broker: &TestBroker, queue: &str) -> u32 {
    let conn = broker.connect().await;
    let q = plumbing::amqp::inspect_queue(&conn, queue).await.unwrap();
    let _ = conn.close(200, "bye".into()).await;
    q.message_count()
}

/// Waits until consumer `name` has at least `n` processed rows (`what` names the wait).
async fn wait_processed(pool: &PgPool, name: &str, n: i64, what: &str) {
    wait_until(what, LONG, || async {
        (processed_rows(pool, name).await >= n).then_some(())
    })
    .await;
}

/// A consumer process started again after the first one died or stopped, once it is ready and
/// the ledger has `updates` updates in all.
async fn restarted_until_applied(
    db: &TestDb,
    exchange: &str,
    name: &str,
    updates: i64,
) -> ConsumerProcess {
    let second = ConsumerProcess::spawn(&db.url, exchange, name, &[]);
    second.wait_ready().await;
    wait_for_updates(&db.pool, updates, LONG).await;
    second
}

/// Waits until the ledger shows `n` applied events in total.
async fn wait_for_updates(pool: &PgPool, n: i64, timeout: Duration) {
    wait_until(&format!("{n} ledger updates"), timeout, || async move {
        let u = total_updates(pool).await;
        assert!(
            u <= n,
            "more updates ({u}) than events ({n}): an effect was applied twice"
        );
        (u == n).then_some(())
    })
    .await;
}

async fn outcome(addr: SocketAddr, consumer: &str, outcome: &str) -> f64 {
    metric(
        addr,
        "consumer_messages_total",
        &[("consumer", consumer), ("outcome", outcome)],
    )
    .await
    .unwrap_or(0.0)
}

/// The `consumer` binary as a child process.
struct ConsumerProcess {
    child: Child,
    metrics: SocketAddr,
}

impl ConsumerProcess {
    fn spawn(db_url: &str, exchange: &str, name: &str, extra: &[&str]) -> Self {
        Self::spawn_logging_to(db_url, exchange, name, extra, Stdio::inherit())
    }

    /// [`ConsumerProcess::spawn`] with its log (stderr) going to `log`.
    fn spawn_logging_to(
        db_url: &str,
        exchange: &str,
        name: &str,
        extra: &[&str],
        log: Stdio,
    ) -> Self {
        let metrics = free_addr();
        let child =
            example_consumer_command("ledger", name, db_url, &amqp_url(), exchange, metrics)
                .args([
                    "--bind",
                    "payment.captured",
                    "--retry-delays",
                    "100ms,200ms",
                ])
                .args(extra)
                .stderr(log)
                .spawn()
                .expect("spawn consumer");
        Self { child, metrics }
    }

    async fn wait_ready(&self) {
        let addr = self.metrics;
        wait_http_ok("consumer /readyz", addr, "/readyz", LONG).await;
    }

    fn sigterm(&self) {
        signals::sigterm(&self.child);
    }

    async fn exit_status(&mut self) -> std::process::ExitStatus {
        tokio::time::timeout(LONG, self.child.wait())
            .await
            .expect("consumer exits in time")
            .unwrap()
    }

    async fn stop(mut self) {
        self.sigterm();
        let status = self.exit_status().await;
        assert!(status.success(), "consumer exit status {status:?}");
    }
}

/// Runs `consumer --name NAME dlq ...` and returns its stdout.
fn dlq_command(name: &str, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(bin_path("consumer"))
        .args(["--name", name, "--amqp-url", &amqp_url(), "dlq"])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run consumer dlq");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn dlq_list(name: &str) -> Vec<serde_json::Value> {
    let (ok, stdout, stderr) = dlq_command(name, &["list", "--json"]);
    assert!(ok, "dlq list failed: {stderr}");
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("dlq list prints JSON lines"))
        .collect()
}

/// Records each application of an effect per consumer: `applied` must end at 1 everywhere.
struct Recorder {
    consumer: String,
}

impl Handler for Recorder {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        sqlx::query(
            "INSERT INTO test_effects (consumer, message_id, applied) VALUES ($1, $2, 1) \
             ON CONFLICT (consumer, message_id) DO UPDATE SET applied = test_effects.applied + 1",
        )
        .bind(&self.consumer)
        .bind(msg.message_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

async fn create_effects_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE test_effects (consumer text, message_id uuid, applied int NOT NULL, \
         PRIMARY KEY (consumer, message_id))",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn effects(pool: &PgPool, consumer: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), COALESCE(max(applied), 0)::bigint FROM test_effects WHERE consumer = $1",
    )
    .bind(consumer)
    .fetch_one(pool)
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Deduplication
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_five_times_is_applied_once() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let mut config = test_config(&name, &exchange);
    let metrics_addr = free_addr();
    config.metrics_addr = Some(metrics_addr);
    let pool = consumer_pool(&db.url, &config).await;
    let running = Running::start(config, pool, demo::ledger::handlers()).await;
    let publisher = Publisher::new(&broker, &exchange).await;

    let twice = payment("acct-dup", 42);
    for _ in 0..5 {
        publisher.publish(&twice).await;
    }
    publisher.publish(&payment("acct-other", 7)).await;

    let stats = running.stats.clone();
    wait_until("6 deliveries settled", LONG, || {
        let s = stats.snapshot();
        async move { (s.settled() == 6).then_some(()) }
    })
    .await;
    let s = running.stats.snapshot();
    assert_eq!(
        (s.processed, s.duplicate, s.dead_lettered, s.retried),
        (2, 4, 0, 0),
        "{s:?}"
    );
    let l = ledger(&db.pool).await;
    assert_eq!(l["acct-dup"], (42, 1));
    assert_eq!(l["acct-other"], (7, 1));
    assert_eq!(processed_rows(&db.pool, &name).await, 2);

    // The same through the metrics endpoint, with the health routes.
    assert_eq!(outcome(metrics_addr, &name, "duplicate").await, 4.0);
    assert_eq!(outcome(metrics_addr, &name, "processed").await, 2.0);
    assert!(
        metric(
            metrics_addr,
            "consumer_handler_duration_seconds_count",
            &[("consumer", &name)]
        )
        .await
        .unwrap_or(0.0)
            >= 2.0
    );
    assert!(
        metric(
            metrics_addr,
            "consumer_end_to_end_latency_seconds_count",
            &[("consumer", &name)]
        )
        .await
        .unwrap_or(0.0)
            >= 2.0
    );
    assert_eq!(http_status(metrics_addr, "/healthz").await, Some(200));
    assert_eq!(http_status(metrics_addr, "/readyz").await, Some(200));
    assert!(running.readiness.ready());
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Crashes and shutdown (the binary as a child process)
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_a_thousand_messages_in_flight_then_restart_applies_each_once() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    // Queue first, so all 1,000 messages wait in it before the consumer starts.
    let _conn = declared_before_start(&broker, &exchange, &name).await;
    let expected = publish_payments(&broker, &exchange, 1000, 17).await;

    // Prefetch 2 x 500: every message is delivered to the process. The first batch of each worker
    // commits, then the worker waits between commit and ack (fault injection) until it is killed.
    let mut first = ConsumerProcess::spawn(
        &db.url,
        &exchange,
        &name,
        &[
            "--workers",
            "2",
            "--prefetch",
            "500",
            "--batch-size",
            "50",
            "--debug-ack-delay",
            "1h",
        ],
    );
    wait_processed(&db.pool, &name, 1, "a committed batch").await;
    first.child.kill().await.unwrap(); // SIGKILL
    let _ = first.child.wait().await;
    let committed = processed_rows(&db.pool, &name).await;
    assert!(
        committed > 0 && committed < 1000,
        "committed before the kill: {committed}"
    );
    assert_eq!(
        total_updates(&db.pool).await,
        committed,
        "each committed effect is in the ledger"
    );

    // Nothing was acknowledged: every message, committed or not, is back in the queue.
    wait_until("all 1,000 messages back in the queue", LONG, || async {
        (queue_depth(&broker, &name).await == 1000).then_some(())
    })
    .await;

    let second = restarted_until_applied(&db, &exchange, &name, 1000).await;
    assert_eq!(
        ledger(&db.pool).await,
        expected,
        "balances and update counts are exact"
    );
    assert_eq!(processed_rows(&db.pool, &name).await, 1000);
    let m = second.metrics;
    let n = name.as_str();
    wait_until("1,000 settled after restart", LONG, || async move {
        let settled = outcome(m, n, "processed").await + outcome(m, n, "duplicate").await;
        (settled == 1000.0).then_some(())
    })
    .await;
    // The committed-but-unacknowledged messages came back and were recognised as duplicates.
    assert_eq!(outcome(m, &name, "duplicate").await, committed as f64);
    assert_eq!(
        outcome(m, &name, "processed").await,
        (1000 - committed) as f64
    );
    assert_eq!(outcome(m, &name, "dead_lettered").await, 0.0);
    second.stop().await;
    assert_eq!(queue_depth(&broker, &name).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_processing_exits_zero_and_loses_or_repeats_nothing() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let _conn = declared_before_start(&broker, &exchange, &name).await;
    let expected = publish_payments(&broker, &exchange, 1000, 13).await;

    // A pause between commit and ack makes it certain that SIGTERM finds committed,
    // unacknowledged batches: shutdown must acknowledge them before exiting.
    let mut first = ConsumerProcess::spawn(
        &db.url,
        &exchange,
        &name,
        &[
            "--workers",
            "2",
            "--batch-size",
            "50",
            "--debug-ack-delay",
            "300ms",
        ],
    );
    wait_processed(&db.pool, &name, 100, "some batches committed").await;
    first.sigterm();
    let status = first.exit_status().await;
    assert_eq!(status.code(), Some(0), "SIGTERM exits 0");
    let committed = processed_rows(&db.pool, &name).await;
    assert_eq!(total_updates(&db.pool).await, committed);
    assert!(
        committed < 1000,
        "the consumer was stopped mid-stream ({committed} committed)"
    );

    let second = restarted_until_applied(&db, &exchange, &name, 1000).await;
    assert_eq!(ledger(&db.pool).await, expected);
    let m = second.metrics;
    let n = name.as_str();
    wait_until("the rest settled after restart", LONG, || async move {
        (outcome(m, n, "processed").await == (1000 - committed) as f64).then_some(())
    })
    .await;
    // Everything committed before SIGTERM had been acknowledged: nothing came back.
    assert_eq!(outcome(m, &name, "duplicate").await, 0.0);
    second.stop().await;
    assert_eq!(queue_depth(&broker, &name).await, 0);
}

// ---------------------------------------------------------------------------------------------
// Several instances, several consumers
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_a_queue_and_two_consumers_each_apply_once() {
    let db = TestDb::new().await;
    create_effects_table(&db.pool).await;
    let broker = TestBroker::new();
    let (exchange, billing) = names(&broker);
    let shipping = unique("cons");
    track_consumer(&broker, &shipping);

    let start = |name: String| {
        let (exchange, url) = (exchange.clone(), db.url.clone());
        async move {
            let mut config = test_config(&name, &exchange);
            config.bindings = vec!["payment.#".into()];
            let pool = consumer_pool(&url, &config).await;
            Running::start(
                config,
                pool,
                Handlers::new().on(
                    "payment.*",
                    Recorder {
                        consumer: name.clone(),
                    },
                ),
            )
            .await
        }
    };
    let billing_a = start(billing.clone()).await;
    let billing_b = start(billing.clone()).await;
    let shipping_a = start(shipping.clone()).await;

    let publisher = Publisher::new(&broker, &exchange).await;
    let (msgs, _) = payments(600, 10);
    publisher.publish_all(&msgs).await;
    publisher.publish_all(&msgs[..100]).await; // 100 duplicates

    let (a, b, s) = (
        billing_a.stats.clone(),
        billing_b.stats.clone(),
        shipping_a.stats.clone(),
    );
    wait_until("every copy settled by every consumer", LONG, || {
        let (a, b, s) = (a.snapshot(), b.snapshot(), s.snapshot());
        async move { (a.settled() + b.settled() == 700 && s.settled() == 700).then_some(()) }
    })
    .await;
    let (a, b, s) = (a.snapshot(), b.snapshot(), s.snapshot());
    assert_eq!(a.processed + b.processed, 600, "{a:?} {b:?}");
    assert_eq!(a.duplicate + b.duplicate, 100);
    assert!(
        a.processed > 0 && b.processed > 0,
        "both instances took part: {a:?} {b:?}"
    );
    assert_eq!((s.processed, s.duplicate), (600, 100));
    // Each consumer applied each message exactly once, independently of the other.
    assert_eq!(effects(&db.pool, &billing).await, (600, 1));
    assert_eq!(effects(&db.pool, &shipping).await, (600, 1));
    assert_eq!(processed_rows(&db.pool, &billing).await, 600);
    assert_eq!(processed_rows(&db.pool, &shipping).await, 600);

    billing_a.stop().await;
    billing_b.stop().await;
    shipping_a.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Poison, retries, dead letters, replay
// ---------------------------------------------------------------------------------------------

/// The ledger, with failure modes chosen by the payload's `mode`.
struct Picky {
    allow_rule: AtomicBool,
}

impl Handler for Picky {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        let attempt = msg
            .headers
            .get(consumer::message::headers::ATTEMPT)
            .and_then(|v| v.as_i64())
            .unwrap_or(1);
        match msg.payload["mode"].as_str() {
            Some("rule") if !self.allow_rule.load(Ordering::SeqCst) => {
                return Err(HandlerError::permanent("refused by business rule"));
            }
            Some("flaky") if attempt < 3 => {
                return Err(HandlerError::transient(format!(
                    "flaky on attempt {attempt}"
                )));
            }
            Some("down") => return Err(HandlerError::transient("dependency is down")),
            _ => {}
        }
        demo::ledger::Ledger::default().handle(tx, msg).await
    }
}

fn with_mode(account: &str, amount: i64, mode: &str) -> NewMessage {
    NewMessage::new(
        "account",
        account,
        "payment.captured",
        json!({"account": account, "amount": amount, "mode": mode}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_with_reasons_retries_work_and_replay_applies_once() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let config = test_config(&name, &exchange); // 3 attempts, retries after 100 ms then 200 ms
    let topology = Topology::new(&name, &config.retry_delays);
    let pool = consumer_pool(&db.url, &config).await;
    let picky = Arc::new(Picky {
        allow_rule: AtomicBool::new(false),
    });
    let running = Running::start(
        config,
        pool,
        Handlers::new().on("payment.captured", picky.clone()),
    )
    .await;
    let publisher = Publisher::new(&broker, &exchange).await;

    // Undecodable: a body that is not JSON, and a message without message_id.
    let bad_json_id = Uuid::now_v7();
    let props =
        relay_properties(&payment("acct-x", 1)).with_message_id(bad_json_id.to_string().into());
    publisher
        .publish_raw(
            "payment.captured",
            props,
            b"{\"account\": \"acct-x\", amount: oops",
        )
        .await;
    let no_id = BasicProperties::default()
        .with_type("payment.captured".into())
        .with_delivery_mode(2);
    publisher
        .publish_raw(
            "payment.captured",
            no_id,
            br#"{"account":"acct-x","amount":1}"#,
        )
        .await;
    // A permanent handler error, a transient one that heals on attempt 3, one that never heals.
    let rule = with_mode("acct-rule", 500, "rule");
    let flaky = with_mode("acct-flaky", 30, "flaky");
    let down = with_mode("acct-down", 9, "down");
    publisher
        .publish_all(&[rule.clone(), flaky.clone(), down.clone()])
        .await;
    // The consumer keeps going.
    let (good, mut expected) = payments(40, 4);
    publisher.publish_all(&good).await;
    expected.insert("acct-flaky".into(), (30, 1));

    let stats = running.stats.clone();
    wait_until("poison dead-lettered and the rest processed", LONG, || {
        let s = stats.snapshot();
        async move { (s.dead_lettered == 4 && s.processed == 41).then_some(()) }
    })
    .await;
    let s = running.stats.snapshot();
    // flaky: retried twice; down: retried twice, then exhausted.
    assert_eq!(s.retried, 4, "{s:?}");
    assert_eq!(ledger(&db.pool).await, expected);
    // A failed message leaves no dedup row behind (it must be processable again).
    assert_eq!(processed_rows(&db.pool, &name).await, 41);

    // `consumer dlq list` shows each dead letter with its reason.
    let letters = dlq_list(&name);
    assert_eq!(letters.len(), 4, "{letters:#?}");
    let find = |id: Option<String>| {
        letters
            .iter()
            .find(|l| l["message_id"].as_str().map(String::from) == id)
            .unwrap_or_else(|| panic!("{id:?}"))
    };
    let l = find(Some(bad_json_id.to_string()));
    assert_eq!(l["kind"], "undecodable");
    assert!(
        l["reason"].as_str().unwrap().contains("not valid JSON"),
        "{l}"
    );
    let l = find(None);
    assert_eq!(l["kind"], "undecodable");
    assert!(
        l["reason"].as_str().unwrap().contains("missing message_id"),
        "{l}"
    );
    let l = find(Some(rule.id.to_string()));
    assert_eq!(l["kind"], "permanent");
    assert!(
        l["reason"]
            .as_str()
            .unwrap()
            .contains("refused by business rule"),
        "{l}"
    );
    assert_eq!(l["event_type"], "payment.captured");
    let l = find(Some(down.id.to_string()));
    assert_eq!(l["kind"], "exhausted");
    assert_eq!(l["attempts"], 3);
    assert!(
        l["reason"].as_str().unwrap().contains("dependency is down"),
        "{l}"
    );
    // Listing left them in place.
    assert_eq!(dlq_list(&name).len(), 4);

    // The rule is fixed; replaying the dead letter applies it once, with its original id.
    picky.allow_rule.store(true, Ordering::SeqCst);
    let (ok, stdout, stderr) = dlq_command(&name, &["replay", &rule.id.to_string()]);
    assert!(ok, "replay failed: {stderr}");
    // A normal replay pages nobody (issue 40, bug 3: the probe for ordered mode logged an ERROR).
    assert!(!stderr.contains("ERROR"), "{stderr}");
    assert!(stdout.contains(&rule.id.to_string()), "{stdout}");
    let stats = running.stats.clone();
    wait_until("the replayed message processed", LONG, || {
        let s = stats.snapshot();
        async move { (s.processed == 42).then_some(()) }
    })
    .await;
    expected.insert("acct-rule".into(), (500, 1));
    assert_eq!(ledger(&db.pool).await, expected);
    assert_eq!(dlq_list(&name).len(), 3);

    // A stale dead letter of a message that was applied meanwhile: replay is deduplicated.
    let applied = &good[0];
    publisher
        .to_queue(
            &topology.dead_letter_queue,
            relay_properties(applied),
            applied.payload.to_string().as_bytes(),
        )
        .await;
    let before = running.stats.snapshot().duplicate;
    let (ok, _, stderr) = dlq_command(&name, &["replay", &applied.id.to_string()]);
    assert!(ok, "replay failed: {stderr}");
    let stats = running.stats.clone();
    wait_until("the stale copy recognised as duplicate", LONG, || {
        let s = stats.snapshot();
        async move { (s.duplicate == before + 1).then_some(()) }
    })
    .await;
    assert_eq!(
        ledger(&db.pool).await,
        expected,
        "replaying an applied message changes nothing"
    );

    // Replaying an id that is not there fails loudly.
    let (ok, _, stderr) = dlq_command(&name, &["replay", &Uuid::now_v7().to_string()]);
    assert!(!ok);
    assert!(stderr.contains("not in the dead-letter queue"), "{stderr}");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_message_in_a_batch_fails_alone() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let _conn = declared_before_start(&broker, &exchange, &name).await;
    // Every third message is refused; all wait in the queue before the consumer starts.
    let mut expected: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let msgs: Vec<NewMessage> = (0..210)
        .map(|i| {
            let account = format!("acct-{}", i % 5);
            if i % 3 == 2 {
                return with_mode(&account, 1_000_000, "rule");
            }
            let e = expected.entry(account.clone()).or_default();
            e.0 += i;
            e.1 += 1;
            with_mode(&account, i, "ok")
        })
        .collect();
    Publisher::new(&broker, &exchange)
        .await
        .publish_all(&msgs)
        .await;

    let mut config = test_config(&name, &exchange);
    config.workers = 1; // one worker: each batch is a run of consecutive messages
    config.prefetch = 300;
    let pool = consumer_pool(&db.url, &config).await;
    let picky = Arc::new(Picky {
        allow_rule: AtomicBool::new(false),
    });
    let running = Running::start(config, pool, Handlers::new().on("payment.captured", picky)).await;
    let stats = running.stats.clone();
    wait_until("all 210 settled", LONG, || {
        let s = stats.snapshot();
        async move { (s.settled() == 210).then_some(()) }
    })
    .await;
    let s = running.stats.snapshot();
    assert_eq!(
        (s.processed, s.dead_lettered, s.retried),
        (140, 70, 0),
        "{s:?}"
    );
    // Fewer batches than 210 / 3: some batch held three consecutive messages, so a refused
    // message shared its transaction with accepted ones, and only it was rolled back.
    assert!(s.batches < 70, "batches: {}", s.batches);
    assert_eq!(ledger(&db.pool).await, expected);
    assert_eq!(processed_rows(&db.pool, &name).await, 140);
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_event_types_are_ignored_or_dead_lettered_in_strict_mode() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, lenient) = names(&broker);
    let strict = unique("cons");
    track_consumer(&broker, &strict);
    let mut running = Vec::new();
    for (name, is_strict) in [(&lenient, false), (&strict, true)] {
        let mut config = test_config(name, &exchange);
        config.bindings = vec!["#".into()];
        config.strict = is_strict;
        let pool = consumer_pool(&db.url, &config).await;
        running.push(Running::start(config, pool, demo::ledger::handlers()).await);
    }
    let publisher = Publisher::new(&broker, &exchange).await;
    publisher
        .publish_all(&[
            NewMessage::new("order", "o-1", "order.placed", json!({"total": 3})),
            payment("acct-1", 5),
        ])
        .await;
    let (l, s) = (running[0].stats.clone(), running[1].stats.clone());
    wait_until("both consumers settled both messages", LONG, || {
        let (l, s) = (l.snapshot(), s.snapshot());
        async move { (l.settled() == 2 && s.settled() == 2).then_some(()) }
    })
    .await;
    let (l, s) = (running[0].stats.snapshot(), running[1].stats.snapshot());
    assert_eq!((l.processed, l.ignored, l.dead_lettered), (1, 1, 0));
    assert_eq!((s.processed, s.ignored, s.dead_lettered), (1, 0, 1));
    let letters = dlq_list(&strict);
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0]["kind"], "unknown_event_type");
    assert_eq!(letters[0]["event_type"], "order.placed");
    // Both consumers applied the payment: two ledger updates for one event, one per consumer.
    assert_eq!(ledger(&db.pool).await["acct-1"], (10, 2));
    for r in running {
        r.stop().await;
    }
}

// ---------------------------------------------------------------------------------------------
// Lost links
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_is_waited_out_without_dead_letters() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let config = test_config(&name, &exchange);
    let pool = consumer_pool(&db.url_via(proxy.addr), &config).await;
    let running = Running::start(config, pool, demo::ledger::handlers()).await;
    let publisher = Publisher::new(&broker, &exchange).await;

    let (msgs, expected) = payments(400, 9);
    publisher.publish_all(&msgs[..200]).await;
    wait_for_updates(&db.pool, 200, LONG).await;

    proxy.set_mode(ProxyMode::Down);
    publisher.publish_all(&msgs[200..]).await;
    let (stats, readiness) = (running.stats.clone(), running.readiness.clone());
    wait_until("the consumer noticed the outage", LONG, || {
        let (s, r) = (stats.snapshot(), readiness.postgres());
        async move { (s.database_failures >= 1 && !r).then_some(()) }
    })
    .await;
    proxy.set_mode(ProxyMode::Pass);

    wait_for_updates(&db.pool, 400, LONG).await;
    assert_eq!(ledger(&db.pool).await, expected);
    let s = running.stats.snapshot();
    assert_eq!(
        (s.dead_lettered, s.retried),
        (0, 0),
        "a database outage is not the message's fault: {s:?}"
    );
    assert_eq!(
        queue_depth(
            &broker,
            &Topology::new(&name, &RETRY_DELAYS).dead_letter_queue
        )
        .await,
        0
    );
    let r = running.readiness.clone();
    wait_until("postgres ready again", LONG, || {
        let r = r.clone();
        async move { r.postgres().then_some(()) }
    })
    .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_broker_link_is_reconnected_and_nothing_is_applied_twice() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let proxy = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let mut config = test_config(&name, &exchange);
    config.amqp_url = format!("amqp://guest:guest@{}/%2f", proxy.addr);
    let pool = consumer_pool(&db.url, &config).await;
    let running = Running::start(config, pool, demo::ledger::handlers()).await;
    let publisher = Publisher::new(&broker, &exchange).await; // direct, not through the proxy

    let (msgs, expected) = payments(400, 7);
    publisher.publish_all(&msgs[..200]).await;
    wait_for_updates(&db.pool, 200, LONG).await;

    proxy.set_mode(ProxyMode::Down);
    let (stats, readiness) = (running.stats.clone(), running.readiness.clone());
    wait_until("the consumer noticed the cut", LONG, || {
        let (s, r) = (stats.snapshot(), readiness.rabbitmq());
        async move { (s.reconnects >= 1 && !r).then_some(()) }
    })
    .await;
    publisher.publish_all(&msgs[200..]).await;
    proxy.set_mode(ProxyMode::Pass);

    wait_for_updates(&db.pool, 400, LONG).await;
    assert_eq!(ledger(&db.pool).await, expected);
    let r = running.readiness.clone();
    wait_until("rabbitmq ready again", LONG, || {
        let r = r.clone();
        async move { r.rabbitmq().then_some(()) }
    })
    .await;
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Retention
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_rows_in_batches_one_instance_at_a_time() {
    use consumer::retention::{Sweep, sweep};
    let db = TestDb::new().await;
    let week = Duration::from_secs(7 * 24 * 3600);
    sqlx::query(
        "INSERT INTO outbox.processed_messages (consumer, message_id, processed_at) \
         SELECT c, gen_random_uuid(), now() - age FROM (VALUES \
           ('a', interval '8 days', 2500), ('a', interval '1 day', 10), ('b', interval '30 days', 5) \
         ) v(c, age, n), generate_series(1, n)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let never = CancellationToken::new();

    // Another instance holds the consumer's sweep lock: this one does nothing.
    let mut other = db.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind("outbox.processed_messages.retention:a")
        .execute(&mut *other)
        .await
        .unwrap();
    assert_eq!(
        sweep(&db.pool, &Default::default(), "a", week, 1000, &never)
            .await
            .unwrap(),
        Sweep::Busy
    );
    other.rollback().await.unwrap();

    assert_eq!(
        sweep(&db.pool, &Default::default(), "a", week, 1000, &never)
            .await
            .unwrap(),
        Sweep::Deleted(2500)
    );
    assert_eq!(processed_rows(&db.pool, "a").await, 10, "recent rows stay");
    assert_eq!(
        processed_rows(&db.pool, "b").await,
        5,
        "other consumers' rows are theirs to sweep"
    );
    assert_eq!(
        sweep(&db.pool, &Default::default(), "a", week, 1000, &never)
            .await
            .unwrap(),
        Sweep::Deleted(0)
    );
}

// ---------------------------------------------------------------------------------------------
// End to end: producer transactions -> relays (one killed) -> consumer
// ---------------------------------------------------------------------------------------------

fn spawn_relay(db_url: &str, exchange: &str) -> Child {
    relays::spawn_relay(
        db_url,
        &amqp_url(),
        exchange,
        free_addr(),
        &FAST_FLAGS[..6], // lease, poll and confirm timeout
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_with_a_relay_killed_mid_stream_balances_are_exact() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let config = test_config(&name, &exchange);
    let pool = consumer_pool(&db.url, &config).await;
    // The consumer first: its queue is bound before anything is published.
    let running = Running::start(config, pool, demo::ledger::handlers()).await;

    let mut doomed = spawn_relay(&db.url, &exchange);
    let mut survivor = spawn_relay(&db.url, &exchange);

    // Producer transactions: 300 of 5 events each, committed while the relays run.
    let (msgs, expected) = payments(1500, 23);
    let producer = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            for chunk in msgs.chunks(5) {
                let mut tx = pool.begin().await.unwrap();
                shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap();
                tx.commit().await.unwrap();
            }
        })
    };

    let deadline = tokio::time::Instant::now() + LONG;
    while running.stats.snapshot().processed < 300 {
        for relay in [&mut doomed, &mut survivor] {
            if let Some(status) = relay.try_wait().unwrap() {
                panic!("a relay exited early: {status:?}");
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for events to flow"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    doomed.kill().await.unwrap(); // SIGKILL, mid-stream
    let _ = doomed.wait().await;
    producer.await.unwrap();

    wait_for_updates(&db.pool, 1500, Duration::from_secs(120)).await;
    assert_eq!(
        ledger(&db.pool).await,
        expected,
        "balances and update counts are exact"
    );
    assert_eq!(processed_rows(&db.pool, &name).await, 1500);
    let s = running.stats.snapshot();
    assert_eq!(s.dead_lettered, 0, "{s:?}");

    signals::sigterm(&survivor);
    let _ = tokio::time::timeout(LONG, survivor.wait()).await;
    running.stop().await;
}

/// The ledger, except that (once armed) a call first says so and waits at a gate: the test holds
/// a batch inside its open transaction.
struct GatedLedger {
    armed: AtomicBool,
    entered: Arc<Notify>,
    gate: Arc<Notify>,
}

impl Handler for GatedLedger {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.entered.notify_one();
            self.gate.notified().await;
        }
        demo::ledger::Ledger::default().handle(tx, msg).await
    }
}

/// The database stops answering (connections open, nothing comes back) while a batch is inside
/// its transaction, and the consumer is told to stop: it leaves the batch unacknowledged once its
/// database watch finds PostgreSQL gone, instead of waiting on the hung statement, and returns.
/// A new instance on a working link applies every message exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_with_the_database_black_holed_mid_batch_returns_in_bounded_time_and_loses_nothing()
{
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let config = test_config(&name, &exchange);
    let pool = consumer_pool(&db.url_via(proxy.addr), &config).await;
    let gated = Arc::new(GatedLedger {
        armed: AtomicBool::new(false),
        entered: Arc::new(Notify::new()),
        gate: Arc::new(Notify::new()),
    });
    let handlers = Handlers::new().on("payment.captured", gated.clone());
    let mut running = Running::start(config.clone(), pool, handlers).await;
    let publisher = Publisher::new(&broker, &exchange).await;
    let (msgs, expected) = payments(200, 7);
    publisher.publish_all(&msgs[..100]).await;
    wait_for_updates(&db.pool, 100, LONG).await;

    // The next batch stops inside its transaction; then the link goes dark and it is let go.
    gated.armed.store(true, Ordering::SeqCst);
    publisher.publish_all(&msgs[100..]).await;
    gated.entered.notified().await;
    proxy.set_mode(ProxyMode::Blackhole);
    gated.gate.notify_one();
    running.shutdown.cancel();
    let handle = running.handle.take().expect("running");
    tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("the consumer returns although PostgreSQL never answers")
        .expect("consumer task")
        .expect("consumer run");

    // The abandoned batch's transaction is still open on the server, holding its dedup rows: the
    // server ends it after idle_in_transaction_session_timeout, which every connection of ours
    // sets to a minute. The test does now what the server would do then.
    let pool = consumer_pool(&db.url, &config).await;
    let timeout: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(timeout, "1min");
    let orphans: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = $1 AND application_name = 'consumer-test' AND state = 'idle in transaction'",
    )
    .bind(&db.name)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        !orphans.is_empty() && orphans.iter().all(|t| *t),
        "the abandoned batches' transactions: {orphans:?}"
    );
    let again = Running::start(config, pool, demo::ledger::handlers()).await;
    wait_for_updates(&db.pool, 200, LONG).await;
    assert_eq!(
        ledger(&db.pool).await,
        expected,
        "each message applied once"
    );
    again.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Broker-owned headers
// ---------------------------------------------------------------------------------------------

/// The main queue pre-declared as the topology would, plus a delivery limit of 1 (as a policy
/// from docs/operations.md would set it), with its dead-letter exchange and queue.
async fn declare_with_delivery_limit(conn: &Connection, topology: &Topology, exchange: &str) {
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    let text = |s: &str| lapin::types::AMQPValue::LongString(s.into());
    args.insert("x-queue-type".into(), text("quorum"));
    args.insert(
        "x-dead-letter-exchange".into(),
        text(&topology.dead_letter_exchange),
    );
    args.insert(
        "x-quorum-initial-group-size".into(),
        lapin::types::AMQPValue::LongLongInt(consumer::topology::QUORUM_INITIAL_GROUP_SIZE),
    );
    args.insert(
        "x-delivery-limit".into(),
        lapin::types::AMQPValue::LongLongInt(1),
    );
    ch.queue_declare(
        topology.queue.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    topology
        .declare(conn, exchange, &["payment.captured".into()])
        .await
        .unwrap();
}

/// Returns `queue`'s next message to it (`basic.nack` with requeue) until the broker
/// dead-letters it for its delivery limit.
async fn exceed_delivery_limit(conn: &Connection, topology: &Topology, broker: &TestBroker) {
    let ch = conn.create_channel().await.unwrap();
    for _ in 0..10 {
        let got = ch
            .basic_get(
                topology.queue.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: false },
            )
            .await
            .unwrap();
        let Some(m) = got else { break };
        m.delivery
            .nack(lapin::options::BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    wait_until("the broker dead-lettered it", LONG, || async {
        (queue_depth(broker, &topology.dead_letter_queue).await == 1).then_some(())
    })
    .await;
    let _ = ch.close(200, "done".into()).await;
}

/// [`Picky`], recording the headers of every delivery its handler sees.
struct HeaderSpy {
    picky: Picky,
    seen: std::sync::Mutex<Vec<serde_json::Map<String, serde_json::Value>>>,
}

impl Handler for HeaderSpy {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(msg.headers.clone());
        }
        self.picky.handle(tx, msg).await
    }
}

/// RabbitMQ 3.x drops a dead-lettered message when its `x-death` says it already left the target
/// queue by dead-lettering with no rejection since (its cycle detection). A dead letter the
/// broker made for the delivery limit carries `x-death` naming the consumer's queue; replayed
/// with that header, then retried through a retry queue, it expires back into the consumer's
/// queue and the broker would drop it, logging only. Copies and replays drop the broker's
/// headers, so it arrives and is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_dead_letter_replayed_then_retried_is_not_dropped_by_cycle_detection() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let config = test_config(&name, &exchange); // 3 attempts, retries after 100 ms then 200 ms
    let topology = Topology::new(&name, &config.retry_delays);
    let conn = broker.connect().await;
    declare_with_delivery_limit(&conn, &topology, &exchange).await;

    // Fails transiently on attempts 1 and 2: two trips through the retry queues.
    let flaky = with_mode("acct-flaky", 30, "flaky");
    let publisher = Publisher::new(&broker, &exchange).await;
    publisher.publish(&flaky).await;
    exceed_delivery_limit(&conn, &topology, &broker).await;
    let letters = dlq_list(&name);
    assert_eq!(letters.len(), 1, "{letters:#?}");
    assert_eq!(letters[0]["kind"], "broker:delivery_limit", "{letters:#?}");
    assert!(
        letters[0]["headers"].get("x-death").is_some(),
        "{letters:#?}"
    );

    let pool = consumer_pool(&db.url, &config).await;
    let spy = Arc::new(HeaderSpy {
        picky: Picky {
            allow_rule: AtomicBool::new(false),
        },
        seen: std::sync::Mutex::new(Vec::new()),
    });
    let running = Running::start(
        config,
        pool,
        Handlers::new().on("payment.captured", spy.clone()),
    )
    .await;
    let (ok, stdout, stderr) = dlq_command(&name, &["replay", &flaky.id.to_string()]);
    assert!(ok, "replay failed: {stderr}");
    assert!(stdout.contains(&flaky.id.to_string()), "{stdout}");

    let stats = running.stats.clone();
    let settled = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let s = stats.snapshot();
            if s.processed == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let s = running.stats.snapshot();
    assert!(
        settled.is_ok(),
        "the replayed message never came back from its retry queue (retried {} times, nothing \
         in the dead-letter queue: {}): the broker dropped it as a dead-letter cycle",
        s.retried,
        queue_depth(&broker, &topology.dead_letter_queue).await,
    );
    assert_eq!(s.retried, 2, "{s:?}");
    assert_eq!(ledger(&db.pool).await.get("acct-flaky"), Some(&(30, 1)));
    // The replayed copy carried none of the broker's headers, and its own history instead; the
    // retried copies only the x-death of their own trip through the retry queue.
    let seen = spy.seen.lock().map(|s| s.clone()).unwrap_or_default();
    // (A failing batch is re-run message by message: a failed attempt may be seen twice.)
    assert!(seen.len() >= 3, "{seen:#?}");
    let replayed = &seen[0];
    for broker_owned in ["x-death", "x-delivery-count", "x-first-death-queue"] {
        assert!(!replayed.contains_key(broker_owned), "{replayed:#?}");
    }
    assert_eq!(replayed["x-replayed-kind"], "broker:delivery_limit");
    assert_eq!(replayed["x-attempt"], 1);
    let retried = &seen[seen.len() - 1];
    assert_eq!(retried["x-attempt"], 3);
    let deaths = retried["x-death"].as_array().cloned().unwrap_or_default();
    assert_eq!(deaths.len(), 1, "{retried:#?}");
    assert_eq!(deaths[0]["reason"], "expired", "{retried:#?}");
    assert_eq!(queue_depth(&broker, &topology.dead_letter_queue).await, 0);
    running.stop().await;
    let _ = conn.close(200, "bye".into()).await;
}

/// Declares `queue` durable with `x-queue-type: kind`: `Err` with the broker's reply code when it
/// exists with another type (RabbitMQ compares the argument).
async fn declare_typed(conn: &Connection, queue: &str, kind: &str) -> Result<(), u16> {
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString(kind.into()),
    );
    let result = ch
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await;
    match result {
        Ok(_) => {
            let _ = ch.close(200, "done".into()).await;
            Ok(())
        }
        Err(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => Err(amqp.get_id()),
            _ => panic!("declaring {queue}: {e}"),
        },
    }
}

/// The dead-letter queue is a classic queue (`x-queue-type: classic`, see
/// `consumer::topology::dead_letter_queue_arguments`; RabbitMQ 3.10 holds an untyped classic queue
/// equivalent to it, so the wire cannot tell them apart): a quorum declaration of it is refused.
/// A dead-letter queue that exists as another type (a quorum queue, as a vhost whose default
/// queue type is quorum makes of an untyped declaration) is used as it is, with a warning, and
/// so is an untyped classic one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_queue_is_declared_classic_explicitly() {
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let topology = Topology::new(&name, &RETRY_DELAYS);
    let conn = broker.connect().await;
    topology
        .declare(&conn, &exchange, &["payment.captured".into()])
        .await
        .unwrap();
    assert_eq!(
        declare_typed(&conn, &topology.dead_letter_queue, "classic").await,
        Ok(())
    );
    assert_eq!(
        declare_typed(&conn, &topology.dead_letter_queue, "quorum").await,
        Err(406)
    );

    let publisher = Publisher::new(&broker, &exchange).await;
    for kind in ["quorum", "untyped"] {
        let (_, old) = names(&broker);
        let old_topology = Topology::new(&old, &RETRY_DELAYS);
        if kind == "quorum" {
            declare_typed(&conn, &old_topology.dead_letter_queue, "quorum")
                .await
                .unwrap();
        } else {
            let ch = conn.create_channel().await.unwrap();
            ch.queue_declare(
                old_topology.dead_letter_queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
        let letter = payment("acct-old", 1);
        publisher
            .to_queue(
                &old_topology.dead_letter_queue,
                relay_properties(&letter),
                letter.payload.to_string().as_bytes(),
            )
            .await;
        old_topology
            .declare(&conn, &exchange, &["payment.captured".into()])
            .await
            .unwrap_or_else(|e| panic!("a {kind} dead-letter queue is used as it is: {e}"));
        assert_eq!(
            queue_depth(&broker, &old_topology.dead_letter_queue).await,
            1,
            "{kind}"
        );
        assert_eq!(dlq_list(&old).len(), 1, "{kind}");
    }
    let _ = conn.close(200, "bye".into()).await;
}

/// A graceful stop while one worker's batch is inside its handler and 49 more deliveries sit in
/// its prefetch buffer: the batch finishes (commit, ack), the consumer is cancelled, and the 49
/// are returned with one `basic.nack` (requeue) before the channel closes; they are ready in the
/// queue, and the next instance applies each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_returns_the_buffered_deliveries_with_a_nack() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let mut config = test_config(&name, &exchange);
    config.workers = 1;
    config.batch_size = 1;
    config.prefetch = 100;
    let pool = consumer_pool(&db.url, &config).await;
    let gated = Arc::new(GatedLedger {
        armed: AtomicBool::new(true),
        entered: Arc::new(Notify::new()),
        gate: Arc::new(Notify::new()),
    });
    let handlers = Handlers::new().on("payment.captured", gated.clone());
    let running = Running::start(config.clone(), pool, handlers).await;
    let expected = publish_payments(&broker, &exchange, 50, 3).await;
    gated.entered.notified().await;
    wait_until("all 50 sent to the consumer", LONG, || async {
        (queue_depth(&broker, &name).await == 0).then_some(())
    })
    .await;

    running.shutdown.cancel();
    gated.gate.notify_one();
    let stats = running.stats.clone();
    running.stop().await;
    let s = stats.snapshot();
    assert_eq!((s.processed, s.returned), (1, 49), "{s:?}");
    assert_eq!(queue_depth(&broker, &name).await, 49);

    let pool = consumer_pool(&db.url, &config).await;
    let again = Running::start(config, pool, demo::ledger::handlers()).await;
    wait_for_updates(&db.pool, 50, LONG).await;
    assert_eq!(
        ledger(&db.pool).await,
        expected,
        "each message applied once"
    );
    again.stop().await;
}

/// A consumer in a crash loop: five times it starts, takes all 1,000 waiting messages into its
/// prefetch buffers (2 workers x 500), commits a first batch per worker without acknowledging it,
/// and is killed (SIGKILL). Every kill returns all 1,000 to the queue, flagged redelivered (and,
/// on a quorum queue, with `x-delivery-count` one higher). Each incarnation counts the
/// redeliveries it took in `consumer_redeliveries_total`; the last one, left running, takes all
/// 1,000 as redeliveries, warns for those whose delivery count reached `--redelivery-warning`,
/// and applies each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_counts_redeliveries_and_warns_near_the_delivery_limit() {
    const KILLS: usize = 5;
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let conn = declared_before_start(&broker, &exchange, &name).await;
    let expected = publish_payments(&broker, &exchange, 1000, 17).await;
    let warn_at = (KILLS - 1).to_string();
    let mut per_incarnation = Vec::new();
    for round in 0..KILLS {
        let mut p = ConsumerProcess::spawn(
            &db.url,
            &exchange,
            &name,
            &[
                "--workers",
                "2",
                "--prefetch",
                "500",
                "--batch-size",
                "50",
                "--debug-ack-delay",
                "1h",
                "--redelivery-warning",
                &warn_at,
            ],
        );
        let m = p.metrics;
        let n = name.as_str();
        let (b, pool) = (&broker, &db.pool);
        wait_until(
            "all 1,000 prefetched and a batch taken",
            LONG,
            || async move {
                // The first incarnation commits; later ones find those committed (duplicates).
                let taken = if round == 0 {
                    processed_rows(pool, n).await > 0
                } else {
                    metric(m, "consumer_redeliveries_total", &[("consumer", n)])
                        .await
                        .unwrap_or(0.0)
                        > 0.0
                };
                (taken && queue_depth(b, n).await == 0).then_some(())
            },
        )
        .await;
        // Let the other worker take its first batch too.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let seen = metric(m, "consumer_redeliveries_total", &[("consumer", n)])
            .await
            .unwrap_or(0.0);
        per_incarnation.push(seen);
        if round > 0 {
            assert!(seen > 0.0, "round {round}: no redelivery counted");
        } else {
            assert_eq!(seen, 0.0, "the first incarnation gets first deliveries");
        }
        p.child.kill().await.unwrap(); // SIGKILL
        let _ = p.child.wait().await;
        wait_until("all 1,000 back in the queue", LONG, || async {
            (queue_depth(&broker, &name).await == 1000).then_some(())
        })
        .await;
    }

    let log_path = std::env::temp_dir().join(format!("{name}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let last = ConsumerProcess::spawn_logging_to(
        &db.url,
        &exchange,
        &name,
        &["--redelivery-warning", &warn_at],
        Stdio::from(log),
    );
    last.wait_ready().await;
    wait_for_updates(&db.pool, 1000, LONG).await;
    assert_eq!(
        ledger(&db.pool).await,
        expected,
        "each message applied once"
    );
    let m = last.metrics;
    let n = name.as_str();
    wait_until("1,000 settled", LONG, || async move {
        let settled = outcome(m, n, "processed").await + outcome(m, n, "duplicate").await;
        (settled == 1000.0).then_some(())
    })
    .await;
    let final_count = metric(m, "consumer_redeliveries_total", &[("consumer", n)])
        .await
        .unwrap_or(0.0);
    last.stop().await;
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let _ = std::fs::remove_file(&log_path);
    let warnings = log
        .lines()
        .filter(|l| l.contains("nears the queue's delivery limit"))
        .count();
    eprintln!(
        "crash loop: consumer_redeliveries_total per killed incarnation {per_incarnation:?}, \
         after the last restart {final_count}; near-limit warnings (x-delivery-count >= {warn_at}): {warnings}"
    );
    assert_eq!(final_count, 1000.0, "every message came back redelivered");
    assert!(
        warnings > 0,
        "no warning at x-delivery-count {warn_at} after {KILLS} kills"
    );
    let _ = conn.close(200, "bye".into()).await;
}

/// The broker cancels a consumer (`basic.cancel`) and leaves its channel open when its queue is
/// deleted, or, on 4.3, when the consumer timeout strikes. A worker waiting out a database outage
/// with a batch in hand notices it there too (not only in its delivery stream): it ends the
/// session and reconnects, re-declaring the queue, while PostgreSQL is still down; once the
/// database is back, new messages are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_cancel_is_noticed_during_a_database_outage() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (exchange, name) = names(&broker);
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let mut config = test_config(&name, &exchange);
    config.workers = 1;
    let pool = consumer_pool(&db.url_via(proxy.addr), &config).await;
    let running = Running::start(config, pool, demo::ledger::handlers()).await;
    let publisher = Publisher::new(&broker, &exchange).await;

    proxy.set_mode(ProxyMode::Down);
    publisher.publish(&payment("acct-lost", 5)).await;
    let stats = running.stats.clone();
    wait_until("the worker waits out the database outage", LONG, || {
        let s = stats.snapshot();
        async move { (s.database_failures > 0).then_some(()) }
    })
    .await;
    assert_eq!(running.stats.snapshot().reconnects, 0);

    // Deleting the queue makes the broker cancel its consumer; the channel stays open.
    let conn = broker.connect().await;
    let version = plumbing::broker_version::BrokerVersion::of(&conn);
    assert!(version.is_some(), "the broker announces its version");
    eprintln!("broker version: {version:?}");
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(
        name.as_str().into(),
        lapin::options::QueueDeleteOptions::default(),
    )
    .await
    .unwrap();
    let stats = running.stats.clone();
    let noticed = tokio::time::timeout(Duration::from_secs(15), async {
        while stats.snapshot().reconnects == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        noticed.is_ok(),
        "the worker kept waiting on its database with a cancelled consumer: {:?}",
        running.stats.snapshot()
    );
    assert!(running.stats.snapshot().database_failures > 0);

    // The session came back (the queue re-declared); with the database back, it applies again.
    proxy.set_mode(ProxyMode::Pass);
    let r = running.readiness.clone();
    wait_until("consuming again", LONG, || {
        let r = r.clone();
        async move { r.rabbitmq().then_some(()) }
    })
    .await;
    publisher.publish(&payment("acct-after", 7)).await;
    wait_for_updates(&db.pool, 1, LONG).await;
    assert_eq!(
        ledger(&db.pool).await.get("acct-after"),
        Some(&(7, 1)),
        "applied after the reconnect"
    );
    running.stop().await;
    let _ = conn.close(200, "bye".into()).await;
}
