//! The relay against real PostgreSQL and RabbitMQ: publishing, order, many relays, crashes,
//! cut links, failures and dead rows, shutdown.

use relay::RelayOptions;
use serde_json::json;
use shared::NewMessage;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use system_tests::relays::{FAST_FLAGS, InProcess, config, test_options};
use system_tests::signals::sigterm;
use system_tests::*;
use tokio::process::Child;

fn spawn_relay(
    db_url: &str,
    exchange: &str,
    metrics: std::net::SocketAddr,
    extra: &[&str],
) -> Child {
    spawn_with(&FAST_FLAGS, db_url, exchange, metrics, extra)
}

/// [`spawn_relay`] with [`relays::PATIENT_FLAGS`]: for tests that inject no failure and count
/// every copy.
fn spawn_patient_relay(
    db_url: &str,
    exchange: &str,
    metrics: std::net::SocketAddr,
    extra: &[&str],
) -> Child {
    spawn_with(&relays::PATIENT_FLAGS, db_url, exchange, metrics, extra)
}

fn spawn_with(
    flags: &[&str],
    db_url: &str,
    exchange: &str,
    metrics: std::net::SocketAddr,
    extra: &[&str],
) -> Child {
    relays::spawn_relay(
        db_url,
        &amqp_url(),
        exchange,
        metrics,
        &[flags, extra].concat(),
    )
}

/// Inserts messages numbered `ns` for each of `aggregates`, `per_tx` rows per transaction,
/// in order per aggregate. Returns all ids.
async fn produce(
    pool: &sqlx::PgPool,
    aggregates: usize,
    ns: std::ops::Range<i64>,
    per_tx: usize,
) -> Vec<uuid::Uuid> {
    let mut all = Vec::new();
    for n in ns {
        for a in 0..aggregates {
            all.push(msg(&format!("agg-{a}"), "thing.happened", n));
        }
    }
    let mut ids = Vec::new();
    for chunk in all.chunks(per_tx) {
        let mut tx = pool.begin().await.unwrap();
        ids.extend(shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap());
        tx.commit().await.unwrap();
    }
    ids
}

/// Checks that, for each aggregate, the first occurrences of its messages are in produce order.
fn assert_first_occurrences_in_order(received: &[Received]) {
    let mut seen = HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    for r in received {
        if !seen.insert(r.message_id.clone()) {
            continue;
        }
        let agg = r.body["aggregate"].as_str().unwrap().to_string();
        let n = r.body["n"].as_i64().unwrap();
        if let Some(prev) = last.insert(agg.clone(), n) {
            assert!(n > prev, "aggregate {agg}: message {n} after {prev}");
        }
    }
}

/// Receives until every one of `ids` arrived (60 s in all), adding to `received`.
async fn receive_all(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Received>,
    received: &mut Vec<Received>,
    ids: &[uuid::Uuid],
    what: &str,
) {
    let want: HashSet<String> = ids.iter().map(|i| i.to_string()).collect();
    let within = Patience::InAll(Duration::from_secs(60));
    receive_rest(rx, received, &want, within, what).await;
}

/// Waits (up to `timeout`) until the outbox holds no row at all (`what` names the wait).
async fn wait_outbox_empty(pool: &sqlx::PgPool, what: &str, timeout: Duration) {
    wait_until(what, timeout, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.messages")
            .fetch_one(pool)
            .await
            .unwrap();
        (n == 0).then_some(())
    })
    .await;
}

/// The message ids among `received`, each once.
fn received_ids(received: &[Received]) -> HashSet<String> {
    received.iter().map(|r| r.message_id.clone()).collect()
}

/// The ids still in the outbox.
async fn left_in_outbox(pool: &sqlx::PgPool) -> HashSet<uuid::Uuid> {
    sqlx::query_scalar("SELECT id FROM outbox.messages")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// The README's table for a relay that sent again what was not confirmed: a queue sees copies
/// of a suffix (1 2 3 2 3 4), never a first copy out of order, and every one of `aggregates`
/// (`agg-0`...) complete up to message `last`. Returns what was observed, for the log.
fn assert_resent_suffixes_only(
    received: &[Received],
    aggregates: usize,
    last: i64,
) -> ordering::Observed {
    assert_first_occurrences_in_order(received);
    let observed = ordering::Observed::new(received);
    observed.assert_only_resends();
    observed.assert_last_copies_in_order();
    let expected = (0..aggregates)
        .map(|a| (format!("agg-{a}"), last))
        .collect();
    observed.assert_complete(&expected, &HashSet::new());
    observed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_rows_are_published_once_and_rolled_back_rows_never() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;

    // Rolled back: must never appear.
    let mut tx = db.pool.begin().await.unwrap();
    let rolled_back = shared::outbox::enqueue(&mut *tx, &msg("r", "thing.rolled_back", 0))
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    // Committed: one with a header and a typed envelope, then a batch.
    let mut tx = db.pool.begin().await.unwrap();
    let first = msg("a", "thing.happened", 0).with_header(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    let first_id = shared::outbox::enqueue(&mut *tx, &first).await.unwrap();
    tx.commit().await.unwrap();
    let ids = produce(&db.pool, 10, 0..20, 50).await;

    let relay = InProcess::on(&db, &exchange, test_options()).await;
    let received = receive_n(&mut rx, 201, Duration::from_secs(30)).await;
    wait_no_pending(&db.pool, Duration::from_secs(10)).await;
    assert!(relay.readiness.ready());
    relay.stop().await;
    let late = drain(&mut rx, Duration::from_millis(300)).await;
    assert!(late.is_empty(), "published more than once: {late:?}");

    let got = received_ids(&received);
    assert_eq!(got.len(), 201, "no duplicates");
    assert!(!got.contains(&rolled_back.to_string()));
    for id in ids.iter().chain([&first_id]) {
        assert!(got.contains(&id.to_string()), "{id} missing");
    }
    assert_first_occurrences_in_order(&received);

    // The AMQP contract.
    let r = received
        .iter()
        .find(|r| r.message_id == first_id.to_string())
        .unwrap();
    assert_eq!(r.routing_key, "thing.happened");
    assert_eq!(
        r.properties.kind().as_ref().unwrap().as_str(),
        "thing.happened"
    );
    assert_eq!(
        r.properties.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(*r.properties.delivery_mode(), Some(2));
    assert!(r.properties.timestamp().unwrap() > 1_700_000_000);
    assert_eq!(r.header("aggregate_type").as_deref(), Some("test"));
    assert_eq!(r.header("aggregate_id").as_deref(), Some("a"));
    assert_eq!(
        r.header("traceparent").as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert!(r.header("created_at").is_some());
    assert_eq!(r.body, json!({"aggregate": "a", "n": 0}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_sql_contract_works_for_any_language() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["order.*"]).await;

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4::jsonb)")
        .bind("order")
        .bind("o-1")
        .bind("order.placed")
        .bind(r#"{"total": 4200}"#)
        .execute(&mut *tx)
        .await
        .unwrap();
    let given = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox.messages (id, aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES ($1, 'order', 'o-1', 'order.paid', '{\"paid\": true}'::jsonb, '{\"tenant\": \"acme\"}'::jsonb)",
    )
    .bind(given)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let relay = InProcess::on(&db, &exchange, test_options()).await;
    let received = receive_n(&mut rx, 2, Duration::from_secs(20)).await;
    relay.stop().await;
    assert_eq!(received[0].routing_key, "order.placed");
    assert_eq!(received[0].body, json!({"total": 4200}));
    uuid::Uuid::parse_str(&received[0].message_id).expect("default id is a uuid");
    assert_eq!(received[1].message_id, given.to_string());
    assert_eq!(received[1].header("tenant").as_deref(), Some("acme"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_publish_10k_rows_once_each_in_aggregate_order() {
    // An empty database: the three relays migrate it concurrently.
    let db = TestDb::new_unmigrated().await;
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(true).await;
    let queue = broker.queue("q");
    let mut rx = collect_queue(&conn, &exchange, &queue, &["#"]).await;
    let metrics: Vec<_> = (0..3).map(|_| free_addr()).collect();
    let mut relays: Vec<Child> = metrics
        .iter()
        .map(|m| spawn_patient_relay(&db.url, &exchange, *m, &[]))
        .collect();

    wait_until("migrated", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox.relay_partitions")
            .fetch_one(&db.pool)
            .await
            .ok()
            .filter(|n| *n == 64)
    })
    .await;
    let ids = produce(&db.pool, 100, 0..100, 250).await;
    let received = receive_n(&mut rx, 10_000, Duration::from_secs(120)).await;

    // Every relay serves its endpoints; and all three took part.
    let http = reqwest::Client::new();
    for m in &metrics {
        let ready = http.get(format!("http://{m}/readyz")).send().await.unwrap();
        assert_eq!(ready.status(), 200);
        let body = http
            .get(format!("http://{m}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(body.contains("relay_owned_partitions"), "{body}");
        assert!(body.contains("outbox_pending_messages"), "{body}");
    }
    for r in &relays {
        sigterm(r);
    }
    for r in &mut relays {
        let status = tokio::time::timeout(Duration::from_secs(20), r.wait())
            .await
            .expect("exits")
            .unwrap();
        assert!(status.success(), "{status:?}");
    }
    let late = drain(&mut rx, Duration::from_millis(300)).await;
    assert!(late.is_empty(), "{} published twice", late.len());
    let got: HashSet<&str> = received.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(got.len(), 10_000, "none twice");
    for id in &ids {
        assert!(got.contains(id.to_string().as_str()));
    }
    assert_first_occurrences_in_order(&received);
    assert_eq!(outbox_count(&db.pool, "pending").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relays_rows_are_published_by_the_other() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let mut a = spawn_relay(
        &db.url,
        &exchange,
        free_addr(),
        &["--batch-size", "50", "--window", "20"],
    );
    let mut b = spawn_relay(
        &db.url,
        &exchange,
        free_addr(),
        &["--batch-size", "50", "--window", "20"],
    );
    // Both hold partitions before the load starts.
    wait_until(
        "both relays own partitions",
        Duration::from_secs(30),
        || async {
            let owners: i64 = sqlx::query_scalar(
                "SELECT count(DISTINCT owner) FROM outbox.relay_partitions WHERE owner IS NOT NULL",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            (owners == 2).then_some(())
        },
    )
    .await;
    let ids = produce(&db.pool, 50, 0..200, 500).await;
    let mut received = receive_n(&mut rx, 500, Duration::from_secs(30)).await;

    a.start_kill().unwrap(); // SIGKILL
    a.wait().await.unwrap();
    // The survivor takes the dead relay's partitions after the 2 s lease and publishes everything.
    receive_all(&mut rx, &mut received, &ids, "published after the kill").await;
    let owner: Vec<Option<String>> =
        sqlx::query_scalar("SELECT DISTINCT owner FROM outbox.relay_partitions")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        owner.len(),
        1,
        "the survivor owns every partition: {owner:?}"
    );
    // The README's table, "relay killed": the takeover publishes again what was not marked, so
    // a queue sees copies of a suffix (1 2 3 2 3 4), never a first copy out of order.
    let observed = assert_resent_suffixes_only(&received, 50, 200);
    eprintln!(
        "relay killed: {} copies; agg-0: {}",
        observed.copies(),
        observed.pattern("agg-0")
    );
    sigterm(&b);
    assert!(b.wait().await.unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_broker_link_loses_nothing_and_marks_nothing_unconfirmed() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let proxy = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let amqp_via_proxy = amqp_url().replace("127.0.0.1:5672", &proxy.addr.to_string());
    let opts = RelayOptions {
        batch_size: 100,
        window: 50,
        ..test_options()
    };
    let relay = InProcess::start(
        db.pool.clone(),
        config(&db.url, &amqp_via_proxy, &exchange, opts),
    )
    .await;

    let mut ids = produce(&db.pool, 20, 0..50, 100).await;
    let mut received = receive_n(&mut rx, 100, Duration::from_secs(30)).await;
    proxy.set_mode(ProxyMode::Down);
    wait_until(
        "relay reports RabbitMQ not ready",
        Duration::from_secs(20),
        || async { (!relay.readiness.rabbitmq()).then_some(()) },
    )
    .await;
    // While the broker is unreachable nothing may be marked: what is gone from the outbox was received.
    ids.extend(produce(&db.pool, 20, 50..70, 100).await);
    let gone_while_down: Vec<uuid::Uuid> = {
        let left = left_in_outbox(&db.pool).await;
        ids.iter().filter(|i| !left.contains(i)).copied().collect()
    };
    received.extend(drain(&mut rx, Duration::from_millis(500)).await);
    let got = received_ids(&received);
    for id in &gone_while_down {
        assert!(
            got.contains(&id.to_string()),
            "{id} was removed from the outbox but never reached the broker"
        );
    }

    // A black-holed link: confirms never come; the confirm timeout notices.
    proxy.set_mode(ProxyMode::Pass);
    wait_until("reconnected", Duration::from_secs(30), || async {
        relay.readiness.rabbitmq().then_some(())
    })
    .await;
    proxy.set_mode(ProxyMode::Blackhole);
    ids.extend(produce(&db.pool, 20, 70..75, 100).await);
    tokio::time::sleep(Duration::from_millis(1500)).await; // let confirms time out against the black hole
    proxy.set_mode(ProxyMode::Down);
    proxy.set_mode(ProxyMode::Pass);

    receive_all(
        &mut rx,
        &mut received,
        &ids,
        "published after the link is back",
    )
    .await;
    wait_no_pending(&db.pool, Duration::from_secs(20)).await;
    // The README's table, "link cut" and "confirm timeout": everything unconfirmed is sent
    // again, so a queue sees copies of a suffix, never a first copy out of order.
    let observed = assert_resent_suffixes_only(&received, 20, 75);
    eprintln!(
        "link cut: {} copies; agg-0: {}",
        observed.copies(),
        observed.pattern("agg-0")
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_database_link_recovers_without_loss() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let relay_pool = plumbing::db::connect(&db.url_via(proxy.addr), 4, "relay-under-test")
        .await
        .unwrap();
    let opts = RelayOptions {
        batch_size: 100,
        window: 50,
        ..test_options()
    };
    let relay = InProcess::start(relay_pool, config(&db.url, &amqp_url(), &exchange, opts)).await;

    let mut ids = produce(&db.pool, 20, 0..50, 100).await;
    let mut received = receive_n(&mut rx, 100, Duration::from_secs(30)).await;
    proxy.set_mode(ProxyMode::Down);
    wait_until(
        "relay reports PostgreSQL not ready",
        Duration::from_secs(20),
        || async { (!relay.readiness.postgres()).then_some(()) },
    )
    .await;
    ids.extend(produce(&db.pool, 20, 50..60, 100).await); // committed while the relay cannot see the database
    proxy.set_mode(ProxyMode::Pass);

    receive_all(
        &mut rx,
        &mut received,
        &ids,
        "published after the link is back",
    )
    .await;
    wait_no_pending(&db.pool, Duration::from_secs(30)).await;
    assert!(relay.readiness.postgres());
    assert_first_occurrences_in_order(&received);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_and_nacked_rows_are_not_marked_then_dead_then_requeued() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(false).await; // no alternate exchange: returns are failures
    // A queue that refuses everything: publishes routed to it are nacked.
    let full = broker.queue("full");
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        lapin::types::AMQPValue::LongString("reject-publish".into()),
    );
    // Durable: RabbitMQ 4.3 refuses transient non-exclusive queues.
    let durable = lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let ch = declare_bound_queue(&conn, &exchange, &full, &["thing.nacked"], durable, args).await;

    let mut tx = db.pool.begin().await.unwrap();
    let unroutable = shared::outbox::enqueue(&mut *tx, &msg("u", "thing.unbound", 0))
        .await
        .unwrap();
    let nacked = shared::outbox::enqueue(&mut *tx, &msg("n", "thing.nacked", 0))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let opts = RelayOptions {
        max_attempts: 3,
        alternate_exchange: false,
        ..test_options()
    };
    let relay = InProcess::on(&db, &exchange, opts).await;
    wait_until("both rows dead", Duration::from_secs(30), || async {
        (outbox_count(&db.pool, "dead").await == 2).then_some(())
    })
    .await;
    let dead = relay::dead_rows::dead_rows(&db.pool, &Default::default(), 10)
        .await
        .unwrap();
    let by_id: HashMap<uuid::Uuid, &relay::dead_rows::DeadRow> =
        dead.iter().map(|d| (d.id, d)).collect();
    assert_eq!(by_id[&unroutable].attempts, 3);
    assert!(
        by_id[&unroutable]
            .last_error
            .as_deref()
            .unwrap()
            .contains("unroutable"),
        "{:?}",
        by_id[&unroutable].last_error
    );
    assert_eq!(by_id[&nacked].attempts, 3);
    assert!(
        by_id[&nacked]
            .last_error
            .as_deref()
            .unwrap()
            .contains("nack")
    );

    // The CLI shows them.
    let out = relays::relay_cli(&db.url, &["dead", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&unroutable.to_string()) && text.contains("unroutable"),
        "{text}"
    );
    assert!(text.contains("2 dead row(s)"), "{text}");

    // Fix the topology, requeue one by id and the rest with --all: both get published.
    let queue = broker.queue("q");
    let mut rx = collect_queue(&conn, &exchange, &queue, &["thing.unbound"]).await;
    ch.queue_delete(full.as_str().into(), Default::default())
        .await
        .unwrap();
    let mut rx2 = collect_queue(&conn, &exchange, &full, &["thing.nacked"]).await;
    let out = relays::relay_cli(&db.url, &["dead", "requeue", &unroutable.to_string()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 row(s) requeued"));
    assert_eq!(
        receive_n(&mut rx, 1, Duration::from_secs(20)).await[0].message_id,
        unroutable.to_string()
    );
    let out = relays::relay_cli(&db.url, &["dead", "requeue", "--all"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 row(s) requeued"));
    assert_eq!(
        receive_n(&mut rx2, 1, Duration::from_secs(20)).await[0].message_id,
        nacked.to_string()
    );
    wait_outbox_empty(&db.pool, "outbox empty", Duration::from_secs(10)).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_row_holds_back_only_its_own_partition_and_order_holds() {
    let (db, exchange, mut rx, declared) = relayed(false, &["thing.ok"]).await;

    // Aggregate "x": ok, unroutable, ok. Other aggregates: ok.
    let mut tx = db.pool.begin().await.unwrap();
    let x = [
        msg("x", "thing.ok", 0),
        msg("x", "thing.later", 1),
        msg("x", "thing.ok", 2),
    ];
    shared::outbox::enqueue_many(&mut *tx, &x).await.unwrap();
    let others: Vec<NewMessage> = (0..50)
        .map(|i| msg(&format!("o{i}"), "thing.ok", 0))
        .collect();
    shared::outbox::enqueue_many(&mut *tx, &others)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let x_partition: i16 = sqlx::query_scalar(
        "SELECT partition FROM outbox.messages WHERE aggregate_id = 'x' LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let same_partition: HashSet<String> = sqlx::query_scalar(
        "SELECT aggregate_id FROM outbox.messages WHERE partition = $1 AND aggregate_id <> 'x'",
    )
    .bind(x_partition)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();

    let opts = RelayOptions {
        max_attempts: 1000,
        alternate_exchange: false,
        retry_base_ms: 100,
        retry_max_ms: 300,
        ..test_options()
    };
    let relay = InProcess::on(&db, &exchange, opts).await;
    // Everything outside x's partition arrives while x.1 keeps failing. x.2 went out right behind
    // x.1 (pipelined) and may sit in the queue once; it is not sent again while x.1 fails.
    let outside: HashSet<String> = others
        .iter()
        .filter(|m| !same_partition.contains(&m.aggregate_id))
        .map(|m| m.id.to_string())
        .chain([x[0].id.to_string()])
        .collect();
    let mut received: Vec<Received> = Vec::new();
    let each = Patience::Each(Duration::from_secs(30));
    receive_rest(
        &mut rx,
        &mut received,
        &outside,
        each,
        "of other partitions flowed",
    )
    .await;
    wait_until("x.1 retried", Duration::from_secs(20), || async {
        let attempts: i32 = sqlx::query_scalar(
            "SELECT attempts FROM outbox.messages WHERE aggregate_id = 'x' AND event_type = 'thing.later'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (attempts >= 2).then_some(())
    })
    .await;
    received.extend(drain(&mut rx, Duration::from_millis(200)).await);
    assert!(
        received
            .iter()
            .filter(|r| r.message_id == x[2].id.to_string())
            .count()
            <= 1,
        "x.2 was sent again while x.1 was still failing"
    );

    // Bind the missing event type: x.1 then x.2 go out, in order, and the partition moves on.
    let ch = declared.conn.create_channel().await.unwrap();
    ch.queue_bind(
        declared.queue.as_str().into(),
        exchange.as_str().into(),
        "thing.later".into(),
        Default::default(),
        Default::default(),
    )
    .await
    .unwrap();
    let all: HashSet<String> = x
        .iter()
        .chain(others.iter())
        .map(|m| m.id.to_string())
        .collect();
    receive_rest(&mut rx, &mut received, &all, each, "flowed after the fix").await;
    // x.2's second copy may still be on its way: wait until every row is marked, then drain.
    wait_no_pending(&db.pool, Duration::from_secs(30)).await;
    received.extend(drain(&mut rx, Duration::from_millis(500)).await);
    let x_order: Vec<i64> = received
        .iter()
        .filter(|r| r.body["aggregate"] == "x")
        .map(|r| r.body["n"].as_i64().unwrap())
        .collect();
    // The README's table, "returned": x.2 (sequence 3) overtook the returned x.1 (2) once and
    // arrives again after it: 1 3 2 3. Every last copy is in order.
    let observed = ordering::Observed::new(&received);
    eprintln!("returned: x: {}", observed.pattern("x"));
    assert!(
        x_order == vec![0, 1, 2] || x_order == vec![0, 2, 1, 2],
        "x arrived as {x_order:?}"
    );
    observed.assert_overtaken_only_by_refusals(&HashSet::from([("x".to_string(), 2)]));
    let mut expected: std::collections::BTreeMap<String, i64> =
        others.iter().map(|m| (m.aggregate_id.clone(), 1)).collect();
    expected.insert("x".into(), 3);
    observed.assert_complete(&expected, &HashSet::new());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_drains_in_flight_and_exits_zero() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let ids = produce(&db.pool, 100, 0..200, 1000).await;
    let mut relay = spawn_patient_relay(&db.url, &exchange, free_addr(), &["--batch-size", "200"]);
    let mut received = receive_n(&mut rx, 1000, Duration::from_secs(30)).await;
    sigterm(&relay);
    let status = tokio::time::timeout(Duration::from_secs(15), relay.wait())
        .await
        .expect("exits in time")
        .unwrap();
    assert!(status.success(), "{status:?}");

    // Stopped at a safe point: every row gone from the outbox was published, nothing twice.
    received.extend(drain(&mut rx, Duration::from_millis(500)).await);
    let left = left_in_outbox(&db.pool).await;
    let got = received_ids(&received);
    assert_eq!(
        got.len(),
        received.len(),
        "no duplicates after a clean stop"
    );
    for id in ids.iter().filter(|i| !left.contains(i)) {
        assert!(
            got.contains(&id.to_string()),
            "{id} removed without being published"
        );
    }
    assert!(
        !left.is_empty(),
        "the test should stop the relay mid-stream"
    );
    // Partitions were handed back at once.
    let owned: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.relay_partitions WHERE owner IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(owned, 0);

    // A new relay finishes the job, still without duplicates.
    let mut relay = spawn_patient_relay(&db.url, &exchange, free_addr(), &[]);
    let rest = receive_n(&mut rx, left.len(), Duration::from_secs(60)).await;
    sigterm(&relay);
    assert!(relay.wait().await.unwrap().success());
    received.extend(rest);
    received.extend(drain(&mut rx, Duration::from_millis(300)).await);
    let got = received_ids(&received);
    assert_eq!(got.len(), ids.len());
    assert_eq!(received.len(), ids.len(), "nothing published twice");
    assert_first_occurrences_in_order(&received);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_rows_are_kept_for_the_retention_then_removed() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let opts = RelayOptions {
        retention_secs: 5,
        ..test_options()
    };
    let relay = InProcess::on(&db, &exchange, opts).await;
    let ids = produce(&db.pool, 5, 0..20, 100).await;
    receive_n(&mut rx, ids.len(), Duration::from_secs(30)).await;
    // Confirmed rows are first kept as published (with their time), not deleted...
    wait_until("rows marked published", Duration::from_secs(10), || async {
        (outbox_count(&db.pool, "published").await + outbox_count(&db.pool, "pending").await == 100
            && outbox_count(&db.pool, "pending").await == 0)
            .then_some(())
    })
    .await;
    // ...and removed by the sweep once the retention has passed.
    wait_outbox_empty(&db.pool, "published rows purged", Duration::from_secs(30)).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_postgres_is_down_reports_not_ready_then_publishes() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    proxy.set_mode(ProxyMode::Down);
    let metrics = free_addr();
    let mut relay = spawn_relay(&db.url_via(proxy.addr), &exchange, metrics, &[]);

    // Alive and serving, but not ready, while PostgreSQL cannot be reached.
    wait_until("/readyz answers 503", Duration::from_secs(20), || async {
        (http_status(metrics, "/readyz").await == Some(503)).then_some(())
    })
    .await;
    let ids = produce(&db.pool, 5, 0..20, 50).await;
    proxy.set_mode(ProxyMode::Pass);

    let received = receive_n(&mut rx, ids.len(), Duration::from_secs(60)).await;
    let got = received_ids(&received);
    assert!(ids.iter().all(|id| got.contains(&id.to_string())));
    assert_first_occurrences_in_order(&received);
    wait_http_ok(
        "/readyz answers 200",
        metrics,
        "/readyz",
        Duration::from_secs(20),
    )
    .await;
    sigterm(&relay);
    assert!(relay.wait().await.unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_confirms_stuck_in_a_black_holed_link_still_exits_zero_in_bounded_time() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let proxy = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let via_proxy = amqp_url().replace("127.0.0.1:5672", &proxy.addr.to_string());
    let mut relay = spawn_relay(&db.url, &exchange, free_addr(), &["--amqp-url", &via_proxy]);
    let first = produce(&db.pool, 10, 0..10, 100).await;
    receive_n(&mut rx, first.len(), Duration::from_secs(30)).await;

    // Confirms stop coming back; the relay is told to stop while publishes are in flight.
    proxy.set_mode(ProxyMode::Blackhole);
    let stuck = produce(&db.pool, 10, 10..20, 100).await;
    wait_until(
        "the stuck rows are claimed",
        Duration::from_secs(10),
        || async {
            let owned: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox.relay_partitions WHERE owner IS NOT NULL",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            (owned > 0).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await; // let the relay send into the black hole
    sigterm(&relay);
    // Bounded by the confirm timeout (800 ms) plus the bounded connection close, not by the broker.
    let status = tokio::time::timeout(Duration::from_secs(15), relay.wait())
        .await
        .expect("the relay exits although the broker never answers")
        .unwrap();
    assert!(status.success(), "{status:?}");
    // Nothing unconfirmed was marked: every stuck row is still in the outbox.
    let left = left_in_outbox(&db.pool).await;
    for id in &stuck {
        assert!(left.contains(id), "{id} was removed without a confirm");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_the_database_black_holed_exits_in_bounded_time_and_loses_nothing() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let mut relay = spawn_relay(&db.url_via(proxy.addr), &exchange, free_addr(), &[]);
    let first = produce(&db.pool, 10, 0..10, 100).await;
    let mut received = receive_n(&mut rx, first.len(), Duration::from_secs(30)).await;

    // The database stops answering (open connections, nothing comes back), more rows are
    // committed directly, and the relay is told to stop while its claims and marks hang.
    proxy.set_mode(ProxyMode::Blackhole);
    let later = produce(&db.pool, 10, 10..20, 100).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    sigterm(&relay);
    let status = tokio::time::timeout(Duration::from_secs(30), relay.wait())
        .await
        .expect("the relay exits although PostgreSQL never answers")
        .unwrap();
    assert!(status.success(), "{status:?}");

    // Nothing lost: a new relay on a working link publishes whatever is still pending (rows
    // confirmed but not marked may come twice, which at-least-once allows).
    let mut relay = spawn_relay(&db.url, &exchange, free_addr(), &[]);
    let all: Vec<uuid::Uuid> = first.iter().chain(&later).copied().collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        received.extend(drain(&mut rx, Duration::from_millis(300)).await);
        let got = received_ids(&received);
        if all.iter().all(|id| got.contains(&id.to_string())) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {} rows published after the restart",
            got.len(),
            all.len()
        );
    }
    assert_eq!(outbox_count(&db.pool, "pending").await, 0);
    sigterm(&relay);
    assert!(relay.wait().await.unwrap().success());
}
