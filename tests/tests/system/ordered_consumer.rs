//! Ordered consumers (issue 22) against real PostgreSQL and RabbitMQ: order per aggregate across
//! instances with a hot aggregate, a gap waited for, stale messages refused, a poison message
//! that parks only its aggregate and the operator's retry and skip, and the fence that stops an
//! instance which lost its partition.

use consumer::ordered::{admin, store::AggregateKey};
use consumer::{Config, Handler, HandlerError, Handlers};
use lapin::Channel;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use relay::encoder::Encoding;
use relay::store::OutboxRow;
use serde_json::json;
use shared::{Envelope, NewMessage};
use sqlx::PgConnection;
use std::collections::BTreeMap;
use std::time::Duration;
use system_tests::consumers::{RunningConsumer, track_consumer};
use system_tests::relays::{InProcess, config as relay_config, test_options};
use system_tests::*;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(90);
const PARTITIONS: u16 = 4;

/// Appends every applied message to `ordered_applied`; fails on payload `{"fail": "transient" |
/// "permanent"}` while `ordered_poison` says so.
#[derive(Clone)]
struct Recorder;

impl Handler for Recorder {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        if let Some(kind) = msg.payload.get("fail").and_then(|v| v.as_str()) {
            let poisoned: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM ordered_poison WHERE message_id = $1)",
            )
            .bind(msg.message_id)
            .fetch_one(&mut *tx)
            .await?;
            if poisoned {
                return Err(if kind == "permanent" {
                    HandlerError::permanent("poison")
                } else {
                    HandlerError::transient("not yet")
                });
            }
        }
        sqlx::query(
            "INSERT INTO ordered_applied (aggregate_type, aggregate_id, seq, message_id) VALUES ($1, $2, $3, $4)",
        )
        .bind(&msg.aggregate_type)
        .bind(&msg.aggregate_id)
        .bind(msg.aggregate_seq)
        .bind(msg.message_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

struct Setup {
    db: TestDb,
    broker: TestBroker,
    exchange: String,
    name: String,
}

impl Setup {
    async fn new() -> Self {
        let db = TestDb::new().await;
        sqlx::raw_sql(
            "CREATE TABLE ordered_applied (position bigserial PRIMARY KEY, aggregate_type text, \
               aggregate_id text, seq bigint, message_id uuid, tx bigint NOT NULL DEFAULT txid_current()); \
             CREATE TABLE ordered_poison (message_id uuid PRIMARY KEY);",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let broker = TestBroker::new();
        let exchange = broker.outbox_exchange("outbox");
        let name = unique("ord");
        track_consumer(&broker, &name, &[], Some(PARTITIONS));
        Self {
            db,
            broker,
            exchange,
            name,
        }
    }

    fn config(&self, instance: &str) -> Config {
        let mut c = Config::new(&self.name, amqp_url(), &self.exchange);
        c.ordered = true;
        c.partitions = PARTITIONS;
        c.lease = Duration::from_secs(2);
        c.gap_timeout = Duration::from_millis(500);
        c.retry_delays = vec![Duration::from_millis(100), Duration::from_millis(200)];
        c.max_attempts = 3;
        c.batch_size = 100;
        c.prefetch = 200;
        c.instance_id = instance.to_string();
        c
    }

    async fn start(&self, instance: &str) -> RunningConsumer {
        self.start_with(instance, Handlers::new().fallback(Recorder))
            .await
    }

    async fn start_with(&self, instance: &str, handlers: Handlers) -> RunningConsumer {
        let config = self.config(instance);
        let pool = plumbing::db::connect(&self.db.url, config.pool_size(), "ordered-test")
            .await
            .unwrap();
        RunningConsumer::start(config, pool, handlers).await
    }

    /// (aggregate_id, seq) in the order their effects were applied.
    async fn applied(&self) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT aggregate_id, seq FROM ordered_applied ORDER BY position")
            .fetch_all(&self.db.pool)
            .await
            .unwrap()
    }

    async fn applied_count(&self) -> usize {
        self.applied().await.len()
    }

    async fn wait_applied(&self, n: usize) {
        wait_until(&format!("{n} effects applied"), LONG, || async {
            (self.applied_count().await >= n).then_some(())
        })
        .await;
    }
}

/// Every aggregate's effects are 1, 2, ... n exactly once, in order.
fn assert_in_order_once(applied: &[(String, i64)], expected: &BTreeMap<String, i64>) {
    let mut by: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (a, s) in applied {
        by.entry(a.as_str()).or_default().push(*s);
    }
    for (aggregate, n) in expected {
        let got = by.get(aggregate.as_str()).cloned().unwrap_or_default();
        let want: Vec<i64> = (1..=*n).collect();
        assert_eq!(
            got, want,
            "aggregate {aggregate}: effects out of order, twice or missing"
        );
    }
    assert_eq!(by.len(), expected.len(), "effects of unexpected aggregates");
}

/// Publishes a numbered message straight to the outbox exchange, as the relay would.
async fn publish(
    s: &Setup,
    ch: &Channel,
    aggregate: &str,
    seq: i64,
    payload: serde_json::Value,
) -> Uuid {
    publish_with_id(s, ch, aggregate, seq, Uuid::now_v7(), payload).await
}

async fn publisher(s: &Setup) -> (lapin::Connection, Channel) {
    s.broker.outbox_publisher(&s.exchange).await
}

#[tokio::test]
async fn three_instances_apply_every_aggregate_in_order_with_a_hot_one() {
    let s = Setup::new().await;
    let instances = [s.start("a").await, s.start("b").await, s.start("c").await];
    let mut expected = BTreeMap::from([("hot".to_string(), 600)]);
    let mut msgs = Vec::new();
    for n in 0..600 {
        msgs.push(NewMessage::new(
            "thing",
            "hot",
            "thing.changed",
            json!({ "n": n }),
        ));
        if n % 3 == 0 {
            let a = format!("cold-{}", n % 90);
            *expected.entry(a.clone()).or_default() += 1;
            msgs.push(NewMessage::new(
                "thing",
                a,
                "thing.changed",
                json!({ "n": n }),
            ));
        }
    }
    for chunk in msgs.chunks(200) {
        let mut tx = s.db.pool.begin().await.unwrap();
        shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
    let relay = InProcess::start(
        s.db.pool.clone(),
        relay_config(&s.db.url, &amqp_url(), &s.exchange, test_options()),
    )
    .await;
    s.wait_applied(msgs.len()).await;
    // A moment more: anything applied twice would show now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_in_order_once(&s.applied().await, &expected);
    // The partitions are shared evenly: 4 over 3 instances is 2, 1, 1 (within a few heartbeats).
    wait_until("partitions spread 2, 1, 1", LONG, || async {
        let counts: Vec<i64> = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.consumer_partitions WHERE consumer = $1 AND owner IS NOT NULL \
             GROUP BY owner ORDER BY 1 DESC",
        )
        .bind(&s.name)
        .fetch_all(&s.db.pool)
        .await
        .unwrap();
        (counts == vec![2, 1, 1]).then_some(())
    })
    .await;
    relay.stop().await;
    // A graceful stop hands the partitions over at once (not after the lease) and leaves the
    // group; the others take them at their next heartbeat.
    let [a, b, c] = instances;
    a.stop().await;
    let held_by_a: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.consumer_partitions WHERE consumer = $1 AND owner = 'a'",
    )
    .bind(&s.name)
    .fetch_one(&s.db.pool)
    .await
    .unwrap();
    assert_eq!(held_by_a, 0, "a stopped instance holds no partition");
    wait_until("b and c hold all 4 partitions, 2 each", LONG, || async {
        let counts: Vec<i64> = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.consumer_partitions WHERE consumer = $1 \
             AND owner IN ('b', 'c') AND lease_until > now() GROUP BY owner",
        )
        .bind(&s.name)
        .fetch_all(&s.db.pool)
        .await
        .unwrap();
        (counts == vec![2, 2]).then_some(())
    })
    .await;
    b.stop().await;
    c.stop().await;
}

#[tokio::test]
async fn a_message_ahead_of_a_gap_waits_for_it_and_stale_ones_are_never_applied() {
    let s = Setup::new().await;
    let one = s.start("a").await;
    let (_conn, ch) = publisher(&s).await;
    publish(&s, &ch, "g", 1, json!({})).await;
    publish(&s, &ch, "g", 3, json!({})).await;
    publish(&s, &ch, "g", 4, json!({})).await;
    s.wait_applied(1).await;
    // 3 and 4 wait for 2, durably (held, acknowledged), and the gap is reported after its timeout.
    wait_until("the gap is reported", LONG, || async {
        let stuck = admin::stuck(
            &s.db.pool,
            &Default::default(),
            &s.name,
            Duration::from_millis(500),
            10,
        )
        .await
        .unwrap();
        stuck
            .iter()
            .any(|x| {
                x.kind == admin::StuckKind::Gap
                    && x.aggregate_id == "g"
                    && x.held == 2
                    && x.applied_seq == 1
            })
            .then_some(())
    })
    .await;
    assert_eq!(s.applied().await, vec![("g".to_string(), 1)]);
    publish(&s, &ch, "g", 2, json!({})).await;
    s.wait_applied(4).await;
    // A copy of 2 and an old 1: stale, not applied.
    publish(&s, &ch, "g", 2, json!({})).await;
    publish(&s, &ch, "g", 1, json!({})).await;
    wait_until("stale messages counted", LONG, || async {
        (one.stats.snapshot().stale >= 2).then_some(())
    })
    .await;
    let applied = s.applied().await;
    assert_in_order_once(&applied, &BTreeMap::from([("g".to_string(), 4)]));
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.consumer_held")
        .fetch_one(&s.db.pool)
        .await
        .unwrap();
    assert_eq!(held, 0);
    one.stop().await;
}

/// An event type without a handler advances its aggregate's position without an effect, so the
/// numbers an ordered consumer sees stay dense (docs/consumer.md, "The rule for subscriptions").
#[tokio::test]
async fn events_without_a_handler_advance_the_position_without_an_effect() {
    let s = Setup::new().await;
    let one = s
        .start_with("a", Handlers::new().on("thing.changed", Recorder))
        .await;
    let (_conn, ch) = publisher(&s).await;
    for (seq, event_type) in [
        (1, "thing.noted"),
        (2, "thing.changed"),
        (3, "thing.noted"),
        (4, "thing.changed"),
    ] {
        publish_event(&s, &ch, "u", seq, Uuid::now_v7(), event_type, json!({})).await;
    }
    s.wait_applied(2).await;
    let position = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT applied_seq FROM outbox.consumer_positions WHERE consumer = $1 AND aggregate_id = 'u'",
        )
        .bind(&s.name)
        .fetch_optional(&s.db.pool)
        .await
        .unwrap()
    };
    wait_until("the position passes the unhandled 3", LONG, || async {
        (position().await == Some(4)).then_some(())
    })
    .await;
    assert_eq!(
        s.applied().await,
        vec![("u".to_string(), 2), ("u".to_string(), 4)],
        "only the handled events have effects, in order"
    );
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.consumer_held")
        .fetch_one(&s.db.pool)
        .await
        .unwrap();
    assert_eq!(held, 0, "nothing waits for an unhandled number");
    one.stop().await;
}

/// Consecutive messages of one aggregate that arrive together are applied in one handler call
/// and one transaction: a hot aggregate is not one commit per message.
#[tokio::test]
async fn consecutive_messages_of_one_aggregate_share_a_transaction() {
    let s = Setup::new().await;
    // Declares the partitions, then stops, so the messages wait in the queue together.
    s.start("a").await.stop().await;
    let (_conn, ch) = publisher(&s).await;
    let n: i64 = 60;
    for seq in 1..=n {
        publish(&s, &ch, "h", seq, json!({})).await;
    }
    let one = s.start("a").await;
    s.wait_applied(n as usize).await;
    one.stop().await;
    assert_in_order_once(&s.applied().await, &BTreeMap::from([("h".to_string(), n)]));
    let (transactions, largest): (i64, i64) = sqlx::query_as(
        "SELECT count(*), coalesce(max(rows), 0) FROM \
           (SELECT tx, count(*) AS rows FROM ordered_applied GROUP BY tx) t",
    )
    .fetch_one(&s.db.pool)
    .await
    .unwrap();
    assert!(
        transactions < n && largest > 1,
        "{n} messages in {transactions} transactions, the largest with {largest}"
    );
}

#[tokio::test]
async fn a_poison_message_parks_only_its_aggregate_and_the_operator_retries_or_skips() {
    let s = Setup::new().await;
    let one = s.start("a").await;
    let (_conn, ch) = publisher(&s).await;
    // p1: 1, then a transient failure that goes on (parks after 3 attempts), then 3, 4.
    // p2: 1, then a permanent failure (parks at once), then 3.
    // ok: flows all along.
    publish(&s, &ch, "p1", 1, json!({})).await;
    let poison1 = Uuid::now_v7();
    sqlx::query("INSERT INTO ordered_poison VALUES ($1)")
        .bind(poison1)
        .execute(&s.db.pool)
        .await
        .unwrap();
    // The handler looks the poison up by message id: publish with that id.
    let id1 = publish_with_id(&s, &ch, "p1", 2, poison1, json!({"fail": "transient"})).await;
    publish(&s, &ch, "p1", 3, json!({})).await;
    publish(&s, &ch, "p1", 4, json!({})).await;
    publish(&s, &ch, "p2", 1, json!({})).await;
    let poison2 = Uuid::now_v7();
    sqlx::query("INSERT INTO ordered_poison VALUES ($1)")
        .bind(poison2)
        .execute(&s.db.pool)
        .await
        .unwrap();
    publish_with_id(&s, &ch, "p2", 2, poison2, json!({"fail": "permanent"})).await;
    publish(&s, &ch, "p2", 3, json!({})).await;
    for n in 1..=5 {
        publish(&s, &ch, "ok", n, json!({})).await;
    }
    let schema = shared::schema::Schema::default();
    wait_until("both poisoned aggregates parked", LONG, || async {
        let stuck = admin::stuck(&s.db.pool, &schema, &s.name, Duration::from_secs(3600), 10)
            .await
            .unwrap();
        let parked: Vec<&str> = stuck
            .iter()
            .filter(|x| x.kind == admin::StuckKind::Parked)
            .map(|x| x.aggregate_id.as_str())
            .collect();
        (parked.len() == 2).then_some(())
    })
    .await;
    let stuck = admin::stuck(&s.db.pool, &schema, &s.name, Duration::from_secs(3600), 10)
        .await
        .unwrap();
    let p1 = stuck.iter().find(|x| x.aggregate_id == "p1").unwrap();
    assert_eq!((p1.applied_seq, p1.attempts, p1.held), (1, 3, 3), "{p1:?}");
    assert_eq!(p1.head_message_id, Some(id1));
    let p2 = stuck.iter().find(|x| x.aggregate_id == "p2").unwrap();
    assert_eq!((p2.applied_seq, p2.attempts, p2.held), (1, 1, 2), "{p2:?}");
    // The other aggregate flowed on.
    s.wait_applied(2 + 5).await;
    let applied = s.applied().await;
    assert_in_order_once(
        &applied,
        &BTreeMap::from([("p1".into(), 1), ("p2".into(), 1), ("ok".into(), 5)]),
    );

    // Retry p1 after fixing the cause: 2, 3, 4 apply in order.
    sqlx::query("DELETE FROM ordered_poison WHERE message_id = $1")
        .bind(poison1)
        .execute(&s.db.pool)
        .await
        .unwrap();
    let key = |id: &str| AggregateKey {
        aggregate_type: "thing".into(),
        aggregate_id: id.into(),
    };
    let p1_key = key("p1");
    let mut tx = s.db.pool.begin().await.unwrap();
    // A position that moved since it was seen is refused and changes nothing.
    let seen_long_ago = admin::Target {
        consumer: &s.name,
        key: &p1_key,
        seen: Some(0),
    };
    assert!(matches!(
        admin::retry_head(&mut tx, &schema, &seen_long_ago).await,
        Err(consumer::error::AdminError::Moved { seen: 0, now: 1 })
    ));
    tx.rollback().await.unwrap();
    let mut tx = s.db.pool.begin().await.unwrap();
    let target = admin::Target {
        consumer: &s.name,
        key: &p1_key,
        seen: Some(1),
    };
    admin::retry_head(&mut tx, &schema, &target).await.unwrap();
    tx.commit().await.unwrap();
    s.wait_applied(10).await;
    // Skip p2's head: dead-lettered, 3 applies.
    let conn = s.broker.connect().await;
    let admin_ch = conn.create_channel().await.unwrap();
    admin_ch
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let p2_key = key("p2");
    let target = admin::Target {
        consumer: &s.name,
        key: &p2_key,
        seen: Some(1),
    };
    let mut tx = s.db.pool.begin().await.unwrap();
    let preview = admin::preview(&mut tx, &schema, &target, admin::Discard::Head)
        .await
        .unwrap();
    assert_eq!((preview.dead_letter, preview.applied_seq), (vec![2], 2));
    let resolved = admin::dead_letter(
        &mut tx,
        &schema,
        &admin_ch,
        &target,
        "operator skipped a poison message",
        admin::Discard::Head,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(resolved.dead_lettered, vec![2]);
    s.wait_applied(11).await;
    let applied = s.applied().await;
    let without_p2: Vec<(String, i64)> =
        applied.iter().filter(|(a, _)| a != "p2").cloned().collect();
    assert_in_order_once(
        &without_p2,
        &BTreeMap::from([("p1".into(), 4), ("ok".into(), 5)]),
    );
    let p2_seqs: Vec<i64> = applied
        .iter()
        .filter(|(a, _)| a == "p2")
        .map(|(_, s)| *s)
        .collect();
    assert_eq!(p2_seqs, vec![1, 3], "2 was skipped, 3 applied after 1");
    let dead = consumer::dlq::list(&amqp_url(), &Default::default(), &s.name, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, Some(poison2.to_string()));
    assert_eq!(dead[0].kind, "operator");
    assert_eq!(dead[0].reason, "operator skipped a poison message");
    one.stop().await;
}

#[tokio::test]
async fn an_instance_that_lost_its_partition_applies_nothing_after() {
    let s = Setup::new().await;
    let one = s.start("a").await;
    let (_conn, ch) = publisher(&s).await;
    publish(&s, &ch, "f", 1, json!({})).await;
    s.wait_applied(1).await;
    // Another instance takes every partition over behind this one's back (as after a pause
    // longer than the lease): a new owner, a new epoch, a fresh lease.
    sqlx::query(
        "UPDATE outbox.consumer_partitions SET owner = 'thief', epoch = epoch + 1, \
         lease_until = now() + interval '1 hour' WHERE consumer = $1",
    )
    .bind(&s.name)
    .execute(&s.db.pool)
    .await
    .unwrap();
    publish(&s, &ch, "f", 2, json!({})).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        s.applied().await,
        vec![("f".to_string(), 1)],
        "fenced: nothing applied"
    );
    // The message is not lost: it waits in its queue for the owner.
    sqlx::query("UPDATE outbox.consumer_partitions SET owner = NULL, lease_until = '-infinity' WHERE consumer = $1")
        .bind(&s.name)
        .execute(&s.db.pool)
        .await
        .unwrap();
    s.wait_applied(2).await;
    assert_in_order_once(&s.applied().await, &BTreeMap::from([("f".to_string(), 2)]));
    one.stop().await;
}

/// Publishes message `id`, number `seq` of aggregate `thing/aggregate`, with the relay's own
/// encoder (its properties and headers, the partition as the outbox computes it), skipping the
/// outbox so a test can send numbers out of order, twice, or never.
async fn publish_with_id(
    s: &Setup,
    ch: &Channel,
    aggregate: &str,
    seq: i64,
    id: Uuid,
    payload: serde_json::Value,
) -> Uuid {
    publish_event(s, ch, aggregate, seq, id, "thing.changed", payload).await
}

/// Publishes message `seq` of aggregate `thing`/`aggregate` as the relay encodes it.
async fn publish_event(
    s: &Setup,
    ch: &Channel,
    aggregate: &str,
    seq: i64,
    id: Uuid,
    event_type: &str,
    payload: serde_json::Value,
) -> Uuid {
    let row = OutboxRow {
        seq,
        id,
        aggregate_type: "thing".into(),
        aggregate_id: aggregate.into(),
        aggregate_seq: seq,
        event_type: event_type.into(),
        payload: payload.to_string(),
        headers: Default::default(),
        created_at: chrono::Utc::now(),
        attempts: 0,
        // messages.partition, as the outbox computes it.
        partition: sqlx::query_scalar("SELECT (hashtextextended($1, 0) & 63)::int2")
            .bind(aggregate)
            .fetch_one(&s.db.pool)
            .await
            .unwrap(),
    };
    let limits = Encoding {
        frame_max: 131_072,
        max_payload_bytes: 1 << 20,
        cloudevents: None,
    };
    let encoded = relay::encoder::encode(&row, &limits).expect("encodable");
    ch.basic_publish(
        s.exchange.as_str().into(),
        encoded.routing_key.as_str().into(),
        BasicPublishOptions::default(),
        row.payload.as_bytes(),
        encoded.properties,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    id
}

/// A console on the test's database that shows the test's consumer (CONSOLE_CONSUMERS); gaps
/// count as stuck after one second.
struct Console(consoles::RunningConsole);

impl Console {
    async fn start(s: &Setup) -> Self {
        let mut config = consoles::test_config(&s.db.url, &[s.name.as_str()]);
        config.ordered_gap_seconds = 1;
        config.secret_fields = vec![];
        Self(consoles::RunningConsole::start(config).await)
    }

    async fn get(&self, token: &str, path: &str) -> (u16, serde_json::Value) {
        let r = self.0.api_get(token, path).await;
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// The web page at `path` as the user of `token` (logged in with it).
    async fn page(&self, token: &str, path: &str) -> String {
        let login = self.0.login_with(token).await;
        let cookie = consoles::session_cookie(&login)
            .and_then(|v| v.split(';').next().map(str::to_string))
            .expect("a session cookie");
        let r = self.0.web_get(&cookie, path).await;
        assert_eq!(r.status(), 200, "{path}");
        r.text().await.unwrap()
    }

    async fn post(
        &self,
        token: &str,
        path: &str,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let r = self.0.api_post(token, path, &body, None).await;
        (r.status().as_u16(), r.json().await.unwrap())
    }
}

/// The console's side of issue 22: a viewer sees the parked aggregate and its held messages
/// (redacted) but may not act; an operator's retry runs at once; a skip is only a request until
/// another person approves it (the requester cannot), on the position seen; the dead letter names
/// both people; a request whose aggregate moved on meanwhile is superseded and cannot be approved.
/// Every step is in the audit log.
#[tokio::test]
async fn the_console_retries_now_and_skips_only_after_a_second_person_approves() {
    let s = Setup::new().await;
    let one = s.start("a").await;
    let (_conn, ch) = publisher(&s).await;
    let schema = shared::schema::Schema::default();
    publish(&s, &ch, "p1", 1, json!({})).await;
    let poison = Uuid::now_v7();
    sqlx::query("INSERT INTO ordered_poison VALUES ($1)")
        .bind(poison)
        .execute(&s.db.pool)
        .await
        .unwrap();
    publish_with_id(
        &s,
        &ch,
        "p1",
        2,
        poison,
        json!({"fail": "permanent", "card_number": "4111111111111111"}),
    )
    .await;
    publish(&s, &ch, "p1", 3, json!({})).await;
    let c = Console::start(&s).await;
    let token = |name: &'static str, role| {
        let pool = s.db.pool.clone();
        let schema = schema.clone();
        async move {
            console::users::create(&pool, &schema, name, role)
                .await
                .unwrap()
                .1
        }
    };
    use console::roles::Role;
    let viewer = token("vera", Role::Viewer).await;
    let operator = token("otto", Role::Operator).await;
    let approver = token("anna", Role::Approver).await;
    let view_path = format!("/api/consumers/{}/ordered", s.name);
    let p1 = wait_until("p1 parked in the console", LONG, || async {
        let (status, v) = c.get(&viewer, &view_path).await;
        assert_eq!(status, 200, "{v}");
        v["stuck"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["aggregate_id"] == "p1").cloned())
            .filter(|x| x["kind"] == "parked")
    })
    .await;
    assert_eq!(p1["version"], 1);
    let held: Vec<i64> = p1["first_held"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["aggregate_seq"].as_i64().unwrap())
        .collect();
    assert_eq!(held, vec![2, 3]);
    assert!(
        !p1.to_string().contains("4111111111111111"),
        "a card number reached the console's answer: {p1}"
    );
    let (_, v) = c.get(&viewer, &view_path).await;
    assert_eq!(
        v["partitions"].as_array().unwrap().len(),
        PARTITIONS as usize
    );
    assert_eq!(v["parked"], 1);
    // The web page: the partition strip and the card; forms only for who may act.
    let page_path = format!("/consumers/{}/ordered", s.name);
    let seen_by_operator = c.page(&operator, &page_path).await;
    for part in [
        "id=\"partitions\"",
        "id=\"stuck-thing%2Fp1\"",
        "id=\"retry-thing%2Fp1\"",
        "id=\"skip-thing%2Fp1\"",
    ] {
        assert!(
            seen_by_operator.contains(part),
            "the operator's page lacks {part}"
        );
    }
    assert!(!seen_by_operator.contains("4111111111111111"));
    // The CLI, a client of the same API.
    let shown = tokio::process::Command::new(bin_path("console"))
        .args([
            "ordered",
            "--url",
            &c.0.base,
            "--token",
            &viewer,
            "show",
            "--consumer",
            &s.name,
        ])
        .output()
        .await
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout).to_string();
    assert!(
        shown.contains("parked thing/p1  version=1  held 2")
            && shown.contains("1 stuck aggregate(s)"),
        "{shown}"
    );
    let seen_by_viewer = c.page(&viewer, &page_path).await;
    assert!(seen_by_viewer.contains("id=\"stuck-thing%2Fp1\""));
    assert!(
        !seen_by_viewer.contains("id=\"retry-thing%2Fp1\""),
        "a viewer gets no forms"
    );

    let act = |action: &str| format!("/api/consumers/{}/ordered/actions/{action}", s.name);
    let body = |version: i64, reason: &str| json!({"aggregate_type": "thing", "aggregate_id": "p1", "version": version, "reason": reason});
    // A viewer may not act; an unknown consumer is a 404; a stale version a 409.
    let (status, _) = c.post(&viewer, &act("retry"), body(1, "look")).await;
    assert_eq!(status, 403);
    let (status, v) = c
        .post(
            &operator,
            "/api/consumers/nobody/ordered/actions/retry",
            body(1, "x"),
        )
        .await;
    assert_eq!(status, 404, "{v}");
    let (status, v) = c.post(&operator, &act("skip"), body(0, "old view")).await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(v.as_object().unwrap().keys().collect::<Vec<_>>(), ["error"]);

    // Retry runs now: the head fails again (still poisoned) and parks again.
    let (status, v) = c
        .post(&operator, &act("retry"), body(1, "try once more"))
        .await;
    assert_eq!(status, 200, "{v}");
    wait_until("the retried head parked again", LONG, || async {
        let attempts: i32 = sqlx::query_scalar(
            "SELECT attempts FROM outbox.consumer_positions WHERE consumer = $1 AND aggregate_id = 'p1' AND parked_at IS NOT NULL",
        )
        .bind(&s.name)
        .fetch_optional(&s.db.pool)
        .await
        .unwrap()?;
        (attempts >= 1).then_some(())
    })
    .await;
    // The dry run says what a skip would dead-letter; the skip itself is a request.
    let mut dry = body(1, "poison");
    dry["dry_run"] = json!(true);
    let (status, v) = c.post(&operator, &act("skip"), dry).await;
    assert_eq!(
        (status, v["would_dead_letter"].clone()),
        (200, json!([2])),
        "{v}"
    );
    let (status, v) = c
        .post(
            &operator,
            &act("skip"),
            body(1, "poison message, ticket 42"),
        )
        .await;
    assert_eq!(status, 202, "{v}");
    let approval = v["approval"].as_str().unwrap().to_string();
    let decide = |verb: &str| format!("/api/approvals/{approval}/{verb}");
    let (status, _) = c
        .post(
            &operator,
            &decide("approve"),
            json!({"reason": "me", "version": 1}),
        )
        .await;
    assert_eq!(status, 403, "nobody approves their own request");
    assert_eq!(s.applied().await.len(), 1, "nothing moved before approval");
    let (status, v) = c
        .post(
            &approver,
            &decide("approve"),
            json!({"reason": "checked the payload", "version": 1}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    s.wait_applied(2).await;
    assert_eq!(
        s.applied().await,
        vec![("p1".to_string(), 1), ("p1".to_string(), 3)]
    );
    let dead = consumer::dlq::list(&amqp_url(), &Default::default(), &s.name, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, Some(poison.to_string()));
    assert_eq!(dead[0].kind, "operator");
    assert!(
        dead[0].reason.contains("ticket 42")
            && dead[0].reason.contains("otto")
            && dead[0].reason.contains("anna"),
        "{}",
        dead[0].reason
    );

    // A gap on p2: a skip is asked, then the missing message arrives: the request is superseded
    // and approving it is refused.
    publish(&s, &ch, "p2", 1, json!({})).await;
    publish(&s, &ch, "p2", 3, json!({})).await;
    let gap = wait_until("p2 waits for a gap in the console", LONG, || async {
        let (_, v) = c.get(&viewer, &view_path).await;
        v["stuck"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["aggregate_id"] == "p2").cloned())
    })
    .await;
    assert_eq!(
        (gap["kind"].clone(), gap["version"].clone()),
        (json!("gap"), json!(1))
    );
    let mut skip_gap = body(1, "2 is lost");
    skip_gap["aggregate_id"] = json!("p2");
    let (status, v) = c.post(&operator, &act("skip"), skip_gap).await;
    assert_eq!(status, 202, "{v}");
    let stale = v["approval"].as_str().unwrap().to_string();
    publish(&s, &ch, "p2", 2, json!({})).await;
    s.wait_applied(5).await;
    let (status, v) = c
        .post(
            &approver,
            &format!("/api/approvals/{stale}/approve"),
            json!({"reason": "ok", "version": 1}),
        )
        .await;
    assert_eq!(status, 409, "{v}");
    assert_eq!(
        consoles::approval_status(&s.db.pool, &stale).await,
        "superseded"
    );
    let p2: Vec<i64> = s
        .applied()
        .await
        .into_iter()
        .filter(|(a, _)| a == "p2")
        .map(|(_, n)| n)
        .collect();
    assert_eq!(
        p2,
        vec![1, 2, 3],
        "the late message applied in order, nothing skipped"
    );

    // The audit log has each step: the denial, the conflict, the retry, the request, the
    // approval with both names.
    let entries = console::audit::list(
        &s.db.pool,
        &schema,
        &console::audit::Filter {
            target: Some(format!("ordered:{}/thing/p1", s.name)),
            ..Default::default()
        },
        true,
    )
    .await
    .unwrap();
    let seen: Vec<(String, String)> = entries
        .iter()
        .map(|e| (e.action.clone(), e.outcome.clone()))
        .collect();
    for want in [
        ("ordered.retry", "denied"),
        ("ordered.skip", "conflict"),
        ("ordered.retry", "succeeded"),
        ("ordered.skip", "requested"),
        ("ordered.skip", "succeeded"),
    ] {
        assert!(
            seen.iter().any(|(a, o)| a == want.0 && o == want.1),
            "no {want:?} audit entry in {seen:?}"
        );
    }
    let done = entries
        .iter()
        .find(|e| e.action == "ordered.skip" && e.outcome == "succeeded")
        .unwrap();
    assert_eq!(
        (done.actor_name.as_str(), done.approver.as_deref()),
        ("otto", Some("anna"))
    );
    one.stop().await;
}

/// A dead letter of an ordered consumer (here a delivery without `aggregate_seq`, dead-lettered
/// as undecodable) is listed, but `dlq replay` refuses it with a reason and what to do instead:
/// the copy would go to `NAME`, which an ordered consumer does not consume, and the letter stays
/// in `NAME.dlq`.
#[tokio::test]
async fn a_dead_letter_of_an_ordered_consumer_is_listed_but_replay_is_refused() {
    let s = Setup::new().await;
    let one = s.start("a").await;
    let (_conn, ch) = publisher(&s).await;
    // As the relay encodes it, without its number.
    let id = Uuid::now_v7();
    let row = OutboxRow {
        seq: 1,
        id,
        aggregate_type: "thing".into(),
        aggregate_id: "x".into(),
        aggregate_seq: 1,
        event_type: "thing.changed".into(),
        payload: "{}".into(),
        headers: Default::default(),
        created_at: chrono::Utc::now(),
        attempts: 0,
        partition: 0,
    };
    let limits = Encoding {
        frame_max: 131_072,
        max_payload_bytes: 1 << 20,
        cloudevents: None,
    };
    let encoded = relay::encoder::encode(&row, &limits).expect("encodable");
    let mut headers = encoded.properties.headers().clone().unwrap_or_default();
    consumer::message::remove(&mut headers, &[plumbing::amqp::headers::AGGREGATE_SEQ]);
    ch.basic_publish(
        s.exchange.as_str().into(),
        encoded.routing_key.as_str().into(),
        BasicPublishOptions::default(),
        row.payload.as_bytes(),
        encoded.properties.clone().with_headers(headers),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let amqp = amqp_url();
    let tls = Default::default();
    let dead = wait_until("the delivery dead-lettered", LONG, || async {
        let d = consumer::dlq::list(&amqp, &tls, &s.name, 10).await.ok()?;
        (!d.is_empty()).then_some(d)
    })
    .await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, Some(id.to_string()));
    assert_eq!(dead[0].kind, "undecodable");

    for selection in [
        consumer::dlq::Selection::All,
        consumer::dlq::Selection::Ids(vec![id.to_string()]),
    ] {
        let refused = consumer::dlq::replay(&amqp, &tls, &s.name, &selection).await;
        let Err(e @ consumer::DlqError::Ordered { .. }) = refused else {
            panic!("replay into an ordered consumer must be refused: {refused:?}");
        };
        let text = e.to_string();
        for what in ["ordered consumer", "publish a new event", "retry", "skip"] {
            assert!(text.contains(what), "{what:?} not in: {text}");
        }
    }
    assert!(matches!(
        consumer::dlq::refuse_ordered(&amqp, &tls, &s.name).await,
        Err(consumer::DlqError::Ordered { .. })
    ));
    // Nothing moved: the letter is still in the DLQ, the plain queue is empty.
    let dead = consumer::dlq::list(&amqp, &tls, &s.name, 10).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let conn = s.broker.connect().await;
    let plain = plumbing::amqp::inspect_queue(&conn, &s.name).await.unwrap();
    assert_eq!(plain.message_count(), 0, "nothing replayed into {}", s.name);
    // An unordered consumer's name is not refused by the check.
    consumer::dlq::refuse_ordered(&amqp, &tls, &unique("plain"))
        .await
        .expect("no ordered exchange: replay allowed");
    one.stop().await;
}
