//! A payment provider that is down (issue 38): payments taken before, during and after a provider
//! outage, run by two `producer worker` instances that share the provider's circuit
//! (`dependencies`), one of them killed and replaced while the circuit is open. The outage is the
//! simulator's switch (`POST /admin/outage`, every call answered 503 with `Retry-After: 1` before
//! anything is done). Nothing may fail, compensate or go to review because of it; every payment
//! is charged exactly once after the recovery; and the provider is not flooded while it is down.

use payment_provider::api::{Charge, ChargeStatus};
use payment_provider::client::Client;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use system_tests::signals::sigkill;
use system_tests::{TestDb, demo_stack, wait_until};
use tokio::process::Child;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const ORDER: &str = r#"{"customer_id":"cust-1","currency":"EUR","items":[{"sku":"sku-1","quantity":1,"unit_price":500}]}"#;
/// Attempts a charge may spend: few, so that an outage spent as attempts would fail payments.
const ATTEMPTS: &str = "4";

struct Drill {
    db: TestDb,
    provider: Child,
    provider_url: String,
    api: demo_stack::ApiClient,
    http: reqwest::Client,
    _shutdown: CancellationToken,
}

impl Drill {
    async fn start() -> Self {
        let db = TestDb::new().await;
        let (provider, provider_url) = demo_stack::spawn_provider(&db, &[]).await;
        let shutdown = CancellationToken::new();
        let (api, key) =
            demo_stack::start_api(&db, processes::Remote::HonoursKey, shutdown.clone()).await;
        Self {
            db,
            provider,
            provider_url,
            api: demo_stack::ApiClient::new(api, key),
            http: reqwest::Client::new(),
            _shutdown: shutdown,
        }
    }

    fn worker(&self, name: &str) -> Child {
        let mut cmd = demo_stack::worker_command(&self.db, &self.provider_url, "honours_key", name);
        cmd.env("WORKER_CONCURRENCY", "8")
            .env("CHARGE_MAX_ATTEMPTS", ATTEMPTS)
            .env("CHARGE_RETRY_INITIAL_MS", "100")
            .env("CHARGE_RETRY_MAX_DELAY_MS", "800")
            .env("PROVIDER_CIRCUIT_THRESHOLD", "3")
            .env("PROVIDER_CIRCUIT_MAX_COOLDOWN", "4s")
            .env("PROVIDER_RESUME_RATE", "10");
        cmd.spawn().expect("spawn producer worker")
    }

    async fn outage(&self, setting: &str) {
        let r = self
            .http
            .post(format!("{}/admin/outage", self.provider_url))
            .json(&json!({ "outage": setting }))
            .send()
            .await
            .expect("admin/outage");
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }

    /// Places an order and requests its payment, as a client does: a 503 from the API's own
    /// database pool (the whole suite loads the machine meanwhile) is retried with the same key.
    async fn pay(&self, n: usize) -> Uuid {
        let r = self
            .api
            .post_retrying_unavailable("/orders", &format!("order-{n}"), ORDER)
            .await;
        assert_eq!(r.status(), 201);
        let order: Value = r.json().await.unwrap();
        let body = json!({"order_id": order["id"], "amount": 500, "currency": "EUR"}).to_string();
        let r = self
            .api
            .post_retrying_unavailable("/payments", &format!("pay-{n}"), &body)
            .await;
        assert_eq!(r.status(), 202);
        let payment: Value = r.json().await.unwrap();
        payment["id"].as_str().unwrap().parse().unwrap()
    }

    /// Pays `rate` payments a second for `d`, from number `from` on.
    async fn pay_for(&self, d: Duration, rate: u32, from: usize, ids: &mut Vec<Uuid>) {
        let start = Instant::now();
        let mut n = from;
        while start.elapsed() < d {
            ids.push(self.pay(n).await);
            n += 1;
            tokio::time::sleep(Duration::from_secs(1) / rate).await;
        }
    }

    async fn scalar_i64(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// The provider's count of calls its outage switch refused.
    async fn refused_calls(&self) -> f64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.provider_url))
            .send()
            .await
            .expect("provider /metrics")
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|l| l.starts_with("provider_outage_refused_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// `rate` payments a second before, during and after an `outage` of the provider.
async fn outage_under_load(outage: Duration, rate: u32) {
    let mut drill = Drill::start().await;
    let mut w1 = drill.worker("outage-w1");
    let mut w2 = drill.worker("outage-w2");
    let mut ids = vec![];
    drill
        .pay_for(Duration::from_secs(3), rate, 0, &mut ids)
        .await;

    drill.outage("503:1").await;
    let down = Instant::now();
    // Half the outage, then the circuit is open for every instance, and steps wait on it.
    drill.pay_for(outage / 2, rate, ids.len(), &mut ids).await;
    let state: String =
        sqlx::query_scalar("SELECT state FROM outbox.dependencies WHERE name = 'provider'")
            .fetch_one(&drill.db.pool)
            .await
            .expect("the provider's circuit exists");
    assert_ne!(state, "closed", "the circuit opened during the outage");
    let waiting = drill
        .scalar_i64("SELECT count(*) FROM outbox.process_steps WHERE error_class IN ('unavailable') OR waiting_for IS NOT NULL")
        .await;
    assert!(waiting > 0, "steps wait for the provider");
    // A restart while the circuit is open: one instance dies, a new one starts; it learns the
    // open circuit from the database, not from memory.
    sigkill(&w2);
    let _ = w2.wait().await;
    let mut w3 = drill.worker("outage-w3");
    drill.pay_for(outage / 2, rate, ids.len(), &mut ids).await;
    let refused = drill.refused_calls().await;
    let down_for = down.elapsed().as_secs_f64();
    drill.outage("off").await;
    drill
        .pay_for(Duration::from_secs(3), rate, ids.len(), &mut ids)
        .await;

    // Every payment succeeds after the recovery; none failed, compensated or needs a person.
    // The waiting ones resume at the workers' resume rate (10/s): allow twice that long.
    let expected = ids.len() as i64;
    let allow = Duration::from_secs(180).max(Duration::from_secs(ids.len() as u64 / 5));
    wait_until("every payment succeeded", allow, || async {
        let done = drill
            .scalar_i64("SELECT count(*) FROM outbox.processes WHERE kind = 'payment' AND status = 'succeeded'")
            .await;
        (done == expected).then_some(())
    })
    .await;
    let bad = drill
        .scalar_i64("SELECT count(*) FROM outbox.processes WHERE status IN ('failed', 'compensating', 'compensated', 'manual_review')")
        .await;
    assert_eq!(bad, 0, "no payment failed, compensated or went to review");
    // Each exactly once at the provider.
    let charges: Vec<Charge> = Client::new(&drill.provider_url, Duration::from_secs(30))
        .unwrap()
        .admin_charges()
        .await
        .expect("admin charges");
    let mut by_ref: HashMap<String, usize> = HashMap::new();
    for c in charges
        .iter()
        .filter(|c| c.status == ChargeStatus::Succeeded)
    {
        *by_ref.entry(c.reference.clone()).or_default() += 1;
    }
    for id in &ids {
        let n = by_ref.get(&id.to_string()).copied().unwrap_or(0);
        assert_eq!(n, 1, "payment {id} charged {n} times");
    }
    // Nobody flooded the provider: the threshold's calls, about one probe a cool-down (2 s
    // doubling to 4 s), and calls of steps already past their admission.
    let per_second = refused / down_for;
    assert!(
        per_second < 2.0,
        "{refused} calls refused in {down_for:.0}s ({per_second:.2}/s) while the circuit was shared"
    );
    // The circuit's story: opened, probed, closed; written by the system.
    let transitions: Vec<String> = sqlx::query_scalar(
        "SELECT to_state FROM outbox.dependency_history WHERE name = 'provider' ORDER BY id",
    )
    .fetch_all(&drill.db.pool)
    .await
    .unwrap();
    assert!(transitions.iter().any(|s| s == "open"), "{transitions:?}");
    assert!(
        transitions.iter().any(|s| s == "half_open"),
        "{transitions:?}"
    );
    assert_eq!(
        transitions.last().map(String::as_str),
        Some("closed"),
        "{transitions:?}"
    );
    eprintln!(
        "outage of {down_for:.0}s: {} payments, {refused} provider calls refused ({per_second:.2}/s), {} circuit transitions",
        ids.len(),
        transitions.len()
    );
    for w in [&mut w1, &mut w3, &mut drill.provider] {
        sigkill(&*w);
        let _ = w.wait().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_two_minute_provider_outage_under_load_fails_no_payment_and_charges_each_once() {
    outage_under_load(Duration::from_secs(120), 4).await;
}

/// Twenty minutes: longer than every attempt's backoff many times over, and past the waiting
/// steps' own recheck (12 to 15 minutes), so it shows that only the business deadline (24 h)
/// ends a wait. Runs first (`.config/nextest.toml`), beside the rest of the suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_twenty_minute_provider_outage_under_load_fails_no_payment_and_charges_each_once() {
    outage_under_load(Duration::from_secs(1200), 1).await;
}

// --- The consumer side --------------------------------------------------------------------------

use consumer::{Config, Handler, HandlerError, Handlers};
use payment_provider::client::NotifyError;
use shared::{Envelope, NewMessage};
use sqlx::PgConnection;
use system_tests::consumers::{RunningConsumer, track_consumer};
use system_tests::relays::{InProcess, test_options};
use system_tests::{TestBroker, amqp_url, unique};

/// Calls the notification service for each event (keyed by message id) and, once it answered,
/// records the effect: the aggregate's number, so the order effects were applied in shows.
struct NotifyAndRecord {
    client: Client,
}

impl Handler for NotifyAndRecord {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        match self
            .client
            .notify(&msg.message_id.to_string(), &msg.payload)
            .await
        {
            Ok(_) => {}
            Err(e @ NotifyError::Unavailable { retry_after, .. }) => {
                return Err(HandlerError::unavailable(e, retry_after));
            }
            Err(e) => return Err(HandlerError::transient(e)),
        }
        sqlx::query(
            "INSERT INTO outage_applied (aggregate_id, seq, message_id) VALUES ($1, $2, $3)",
        )
        .bind(&msg.aggregate_id)
        .bind(msg.aggregate_seq)
        .bind(msg.message_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// Records order events: a handler that needs no remote.
struct RecordOrder;

impl Handler for RecordOrder {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO outage_orders (message_id) VALUES ($1)")
            .bind(msg.message_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// A consumer whose notification service goes down for longer than all its retry delays.
async fn consumer_outage(ordered: bool) {
    let mut drill = Drill::start().await;
    sqlx::raw_sql(
        "CREATE TABLE outage_applied (position bigserial PRIMARY KEY, aggregate_id text, seq bigint, message_id uuid); \
         CREATE TABLE outage_orders (message_id uuid PRIMARY KEY);",
    )
    .execute(&drill.db.pool)
    .await
    .unwrap();
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outage");
    let name = unique("notify");
    let retry_delays = vec![Duration::from_millis(200), Duration::from_secs(1)];
    track_consumer(&broker, &name, &retry_delays, ordered.then_some(4));
    let mut config = Config::new(&name, amqp_url(), &exchange);
    config.retry_delays = retry_delays.clone();
    // Three attempts: an outage spent as attempts would dead-letter (or park) within 2 seconds.
    config.max_attempts = 3;
    if ordered {
        config.ordered = true;
        config.partitions = 4;
        config.lease = Duration::from_secs(2);
        config.gap_timeout = Duration::from_millis(500);
    }
    let dependency = breaker::Dependency::new(
        "notifications",
        breaker::Policy::default()
            .consecutive(3)
            .cooldown(Duration::from_secs(1), Duration::from_secs(3)),
    )
    .unwrap();
    let client = Client::new(&drill.provider_url, Duration::from_secs(5)).unwrap();
    let handlers = Handlers::new()
        .on_needing("payment.captured", dependency, NotifyAndRecord { client })
        .on("order.placed", RecordOrder);
    let pool = plumbing::db::connect(&drill.db.url, config.pool_size(), "outage-consumer")
        .await
        .unwrap();
    let consumer = RunningConsumer::start(config, pool, handlers).await;
    let relay = InProcess::on(&drill.db, &exchange, test_options()).await;

    let enqueue = |event: &'static str, aggregate: String, n: usize| {
        let pool = drill.db.pool.clone();
        async move {
            let msg = NewMessage::new(
                event.split('.').next().unwrap(),
                aggregate,
                event,
                json!({ "n": n }),
            );
            shared::outbox::enqueue(&pool, &msg).await.unwrap();
        }
    };
    // Before the outage: some notifications go through.
    for n in 0..10 {
        enqueue("payment.captured", format!("acct-{}", n % 5), n).await;
    }
    wait_until(
        "the first notifications",
        Duration::from_secs(60),
        || async {
            (drill
                .scalar_i64("SELECT count(*) FROM outage_applied")
                .await
                >= 10)
                .then_some(())
        },
    )
    .await;

    drill.outage("503:1").await;
    let down = Instant::now();
    for n in 10..60 {
        enqueue("payment.captured", format!("acct-{}", n % 5), n).await;
        enqueue("order.placed", format!("order-{n}"), n).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The orders' handler needs no remote: it flows on during the outage.
    wait_until(
        "orders applied during the outage",
        Duration::from_secs(60),
        || async {
            (drill.scalar_i64("SELECT count(*) FROM outage_orders").await == 50).then_some(())
        },
    )
    .await;
    // Longer than every retry delay many times over.
    tokio::time::sleep(Duration::from_secs(15).saturating_sub(down.elapsed())).await;
    let during = drill
        .scalar_i64("SELECT count(*) FROM outage_applied")
        .await;
    assert_eq!(
        during, 10,
        "nothing was notified while the service was down"
    );
    let refused = drill.refused_calls().await;
    let down_for = down.elapsed().as_secs_f64();
    drill.outage("off").await;

    wait_until(
        "every notification applied",
        Duration::from_secs(120),
        || async {
            (drill
                .scalar_i64("SELECT count(*) FROM outage_applied")
                .await
                >= 60)
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Once each, and in each aggregate's order in ordered mode.
    let applied: Vec<(String, i64, Uuid)> = sqlx::query_as(
        "SELECT aggregate_id, seq, message_id FROM outage_applied ORDER BY position",
    )
    .fetch_all(&drill.db.pool)
    .await
    .unwrap();
    assert_eq!(applied.len(), 60, "each effect once");
    let distinct: std::collections::HashSet<Uuid> = applied.iter().map(|a| a.2).collect();
    assert_eq!(distinct.len(), 60);
    if ordered {
        let mut by: HashMap<&str, Vec<i64>> = HashMap::new();
        for (a, seq, _) in &applied {
            by.entry(a.as_str()).or_default().push(*seq);
        }
        for (a, seqs) in by {
            let want: Vec<i64> = (1..=seqs.len() as i64).collect();
            assert_eq!(seqs, want, "aggregate {a} applied in order");
        }
        let parked = drill
            .scalar_i64(
                "SELECT count(*) FROM outbox.consumer_positions WHERE parked_at IS NOT NULL",
            )
            .await;
        assert_eq!(parked, 0, "no aggregate parked for the outage");
    }
    let stats = consumer.stats.snapshot();
    assert_eq!(
        stats.dead_lettered, 0,
        "nothing dead-lettered for the outage: {stats:?}"
    );
    if !ordered {
        assert!(
            stats.waited > 0,
            "messages waited in the retry queues: {stats:?}"
        );
    }
    // The service was not flooded: about a probe a cool-down (1 s doubling to 3 s) and the calls
    // that opened the circuit.
    let per_second = refused / down_for;
    assert!(
        per_second < 3.0,
        "{refused} calls refused in {down_for:.0}s ({per_second:.2}/s)"
    );
    eprintln!(
        "consumer outage (ordered: {ordered}) of {down_for:.0}s: {refused} calls refused ({per_second:.2}/s), {stats:?}"
    );
    relay.stop().await;
    consumer.stop().await;
    sigkill(&drill.provider);
    let _ = drill.provider.wait().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_whose_remote_is_down_longer_than_its_retries_dead_letters_nothing() {
    consumer_outage(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ordered_consumer_whose_remote_is_down_parks_nothing_and_keeps_each_aggregates_order() {
    consumer_outage(true).await;
}

/// A consumer whose every handler needs the notification service stops taking deliveries while
/// the service's circuit holds calls back: the backlog stays in its queue (not cycling through
/// the retry queues), a probe at a time finds out when the service is back, and then every
/// message is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_whose_every_handler_needs_the_down_remote_stops_taking_deliveries() {
    let mut drill = Drill::start().await;
    sqlx::raw_sql(
        "CREATE TABLE outage_applied (position bigserial PRIMARY KEY, aggregate_id text, seq bigint, message_id uuid);",
    )
    .execute(&drill.db.pool)
    .await
    .unwrap();
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("pause");
    let name = unique("notify_only");
    let retry_delays = vec![Duration::from_millis(200), Duration::from_secs(1)];
    track_consumer(&broker, &name, &retry_delays, None);
    let mut config = Config::new(&name, amqp_url(), &exchange);
    config.retry_delays = retry_delays.clone();
    config.max_attempts = 3;
    let dependency = breaker::Dependency::new(
        "notifications",
        breaker::Policy::default()
            .consecutive(3)
            .cooldown(Duration::from_secs(1), Duration::from_secs(3)),
    )
    .unwrap();
    let client = Client::new(&drill.provider_url, Duration::from_secs(5)).unwrap();
    let handlers =
        Handlers::new().on_needing("payment.captured", dependency, NotifyAndRecord { client });
    let pool = plumbing::db::connect(&drill.db.url, config.pool_size(), "pause-consumer")
        .await
        .unwrap();
    let consumer = RunningConsumer::start(config, pool, handlers).await;
    let relay = InProcess::on(&drill.db, &exchange, test_options()).await;
    let enqueue = |n: usize| {
        let pool = drill.db.pool.clone();
        async move {
            let msg = NewMessage::new(
                "payment",
                format!("acct-{}", n % 5),
                "payment.captured",
                json!({ "n": n }),
            );
            shared::outbox::enqueue(&pool, &msg).await.unwrap();
        }
    };
    drill.outage("503:1").await;
    // A few messages open the circuit.
    for n in 0..5 {
        enqueue(n).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let waited_before = consumer.stats.snapshot().waited;
    for n in 5..155 {
        enqueue(n).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let conn = broker.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let queue = consumer::topology::Topology::new(&name, &retry_delays).queue;
    let ready = ch
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap()
        .message_count();
    let stats = consumer.stats.snapshot();
    let cycled = stats.waited - waited_before;
    assert!(
        ready >= 120,
        "the backlog stays in the queue while the service is down: {ready} ready, {stats:?}"
    );
    assert!(
        cycled <= 30,
        "a paused consumer takes one probe message at a time, not a prefetch's worth: {cycled} waits, {stats:?}"
    );
    assert_eq!(
        drill
            .scalar_i64("SELECT count(*) FROM outage_applied")
            .await,
        0
    );
    drill.outage("off").await;
    wait_until(
        "every notification applied",
        Duration::from_secs(120),
        || async {
            (drill
                .scalar_i64("SELECT count(*) FROM outage_applied")
                .await
                >= 155)
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (total, distinct) = (
        drill
            .scalar_i64("SELECT count(*) FROM outage_applied")
            .await,
        drill
            .scalar_i64("SELECT count(DISTINCT message_id) FROM outage_applied")
            .await,
    );
    assert_eq!((total, distinct), (155, 155), "each effect once");
    assert_eq!(consumer.stats.snapshot().dead_lettered, 0);
    eprintln!("paused consumer: {ready} stayed in the queue, {cycled} waits cycled, {stats:?}");
    relay.stop().await;
    consumer.stop().await;
    sigkill(&drill.provider);
    let _ = drill.provider.wait().await;
}

/// Always answers that its remote is unavailable.
struct AlwaysDown;

impl Handler for AlwaysDown {
    async fn handle(&self, _: &mut PgConnection, _: &Envelope) -> Result<(), HandlerError> {
        Err(HandlerError::unavailable("503 from the remote", None))
    }
}

/// Always refuses for real: a 402, an answer that decides something.
struct AlwaysDeclines;

impl Handler for AlwaysDeclines {
    async fn handle(&self, _: &mut PgConnection, _: &Envelope) -> Result<(), HandlerError> {
        Err(HandlerError::permanent("402 Payment Required: declined"))
    }
}

/// A remote that refuses for real through a dependency: the message is dead-lettered as it
/// always was (a refusal is an answer), and the dependency's circuit stays closed however many
/// refusals there are.
#[tokio::test]
async fn a_real_refusal_through_a_dependency_is_still_dead_lettered_and_never_opens_the_circuit() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outage-402");
    let name = unique("declines");
    let retry_delays = vec![Duration::from_millis(200)];
    track_consumer(&broker, &name, &retry_delays, None);
    let mut config = Config::new(&name, amqp_url(), &exchange);
    config.retry_delays = retry_delays;
    let dependency =
        breaker::Dependency::new("declines", breaker::Policy::default().consecutive(2)).unwrap();
    let pool = plumbing::db::connect(&db.url, config.pool_size(), "outage-402")
        .await
        .unwrap();
    let consumer = RunningConsumer::start(
        config,
        pool,
        Handlers::new().on_needing("payment.captured", dependency, AlwaysDeclines),
    )
    .await;
    let relay = InProcess::on(&db, &exchange, test_options()).await;
    for n in 0..5 {
        let msg = NewMessage::new(
            "payment",
            format!("acct-{n}"),
            "payment.captured",
            json!({"n": n}),
        );
        shared::outbox::enqueue(&db.pool, &msg).await.unwrap();
    }
    wait_until(
        "every message is dead-lettered",
        Duration::from_secs(60),
        || async { (consumer.stats.snapshot().dead_lettered == 5).then_some(()) },
    )
    .await;
    let stats = consumer.stats.snapshot();
    assert_eq!((stats.waited, stats.retried), (0, 0), "{stats:?}");
    let state: String =
        sqlx::query_scalar("SELECT state FROM outbox.dependencies WHERE name = 'declines'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(state, "closed", "five refusals are answers, not an outage");
    relay.stop().await;
    consumer.stop().await;
}

/// A consumer with no retry queue has nowhere to wait: an unavailable answer counts as a
/// transient failure, so the message ends in the dead-letter queue with the reason instead of
/// going round the main queue for ever.
#[tokio::test]
async fn without_retry_queues_an_unavailable_remote_is_a_counted_failure_not_a_hot_loop() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outage-noretry");
    let name = unique("noretry");
    track_consumer(&broker, &name, &[], None);
    let mut config = Config::new(&name, amqp_url(), &exchange);
    config.max_attempts = 1;
    config.retry_delays = vec![];
    let pool = plumbing::db::connect(&db.url, config.pool_size(), "outage-noretry")
        .await
        .unwrap();
    let consumer = RunningConsumer::start(
        config,
        pool,
        Handlers::new().on("payment.captured", AlwaysDown),
    )
    .await;
    let relay = InProcess::on(&db, &exchange, test_options()).await;
    let msg = NewMessage::new("payment", "acct-1", "payment.captured", json!({"n": 1}));
    shared::outbox::enqueue(&db.pool, &msg).await.unwrap();
    wait_until(
        "the message is dead-lettered",
        Duration::from_secs(60),
        || async { (consumer.stats.snapshot().dead_lettered == 1).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stats = consumer.stats.snapshot();
    assert_eq!(
        (stats.dead_lettered, stats.waited, stats.retried),
        (1, 0, 0),
        "{stats:?}"
    );
    let depth = consumer::dlq::depth(&amqp_url(), &Default::default(), &name)
        .await
        .unwrap();
    assert_eq!(depth, 1);
    relay.stop().await;
    consumer.stop().await;
}

/// A handler that names a dependency asks its circuit from inside its batch transaction: on a
/// pool with exactly one connection per worker (all held by the batches) that read must not wait
/// for a connection the batches hold. The circuit is read on every call here (no cache).
#[tokio::test]
async fn a_dependency_read_inside_the_batch_never_waits_for_the_batches_connections() {
    let drill = Drill::start().await;
    sqlx::raw_sql(
        "CREATE TABLE outage_applied (position bigserial PRIMARY KEY, aggregate_id text, seq bigint, message_id uuid)",
    )
    .execute(&drill.db.pool)
    .await
    .unwrap();
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outage-pool");
    let name = unique("pool");
    let retry_delays = vec![Duration::from_millis(200)];
    track_consumer(&broker, &name, &retry_delays, None);
    let mut config = Config::new(&name, amqp_url(), &exchange);
    config.retry_delays = retry_delays;
    config.workers = 2;
    config.batch_size = 1;
    let dependency = breaker::Dependency::new(
        "notifications",
        breaker::Policy::default().cache_for(Duration::ZERO),
    )
    .unwrap();
    let client = Client::new(&drill.provider_url, Duration::from_secs(5)).unwrap();
    let handlers =
        Handlers::new().on_needing("payment.captured", dependency, NotifyAndRecord { client });
    // One connection per worker, nothing spare.
    let pool = plumbing::db::connect(&drill.db.url, config.workers as u32, "outage-pool")
        .await
        .unwrap();
    let consumer = RunningConsumer::start(config, pool, handlers).await;
    let relay = InProcess::on(&drill.db, &exchange, test_options()).await;
    for n in 0..20 {
        let msg = NewMessage::new(
            "payment",
            format!("acct-{n}"),
            "payment.captured",
            json!({"n": n}),
        );
        shared::outbox::enqueue(&drill.db.pool, &msg).await.unwrap();
    }
    wait_until(
        "every notification applied",
        Duration::from_secs(60),
        || async {
            (drill
                .scalar_i64("SELECT count(*) FROM outage_applied")
                .await
                == 20)
                .then_some(())
        },
    )
    .await;
    let stats = consumer.stats.snapshot();
    assert_eq!(
        (stats.database_failures, stats.dead_lettered),
        (0, 0),
        "{stats:?}"
    );
    relay.stop().await;
    consumer.stop().await;
}

/// Only the business deadline ends a wait for the provider: past `CHARGE_DEADLINE_SECS` a payment
/// whose provider never came back fails and releases its order; nothing was charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_business_deadline_ends_a_wait_for_the_provider_as_a_failure_that_charged_nothing() {
    let mut drill = Drill::start().await;
    drill.outage("503:1").await;
    let mut cmd =
        demo_stack::worker_command(&drill.db, &drill.provider_url, "honours_key", "deadline-w");
    cmd.env("CHARGE_MAX_ATTEMPTS", ATTEMPTS)
        .env("CHARGE_DEADLINE_SECS", "6")
        .env("PROVIDER_CIRCUIT_THRESHOLD", "2")
        .env("PROVIDER_CIRCUIT_MAX_COOLDOWN", "2s");
    let mut worker = cmd.spawn().expect("spawn producer worker");
    let ids = [drill.pay(0).await, drill.pay(1).await];
    wait_until("both payments ended", Duration::from_secs(90), || async {
        let ended = drill
            .scalar_i64("SELECT count(*) FROM outbox.processes WHERE kind = 'payment' AND status IN ('failed', 'compensated')")
            .await;
        (ended == 2).then_some(())
    })
    .await;
    let review = drill
        .scalar_i64("SELECT count(*) FROM outbox.processes WHERE status = 'manual_review'")
        .await;
    assert_eq!(review, 0, "nothing was in doubt: no person needed");
    let reasons: Vec<String> = sqlx::query_scalar(
        "SELECT s.error_message FROM outbox.process_steps s JOIN outbox.processes p ON p.id = s.process_id \
         WHERE p.kind = 'payment' AND s.name = 'charge' AND s.role = 'forward' AND s.status = 'failed'",
    )
    .fetch_all(&drill.db.pool)
    .await
    .unwrap();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    for r in &reasons {
        assert!(
            r.contains("deadline passed while the remote was unavailable"),
            "{r}"
        );
    }
    let charges = Client::new(&drill.provider_url, Duration::from_secs(30))
        .unwrap()
        .admin_charges()
        .await
        .unwrap();
    for id in ids {
        assert!(
            !charges.iter().any(|c| c.reference == id.to_string()),
            "payment {id} was never charged"
        );
    }
    for c in [&mut worker, &mut drill.provider] {
        sigkill(&*c);
        let _ = c.wait().await;
    }
}
