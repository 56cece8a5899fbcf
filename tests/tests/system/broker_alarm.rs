//! RabbitMQ resource alarms on a node of the test's own: when the broker blocks publishers
//! (`connection.blocked`), the relay stops publishing, answers /readyz 503 and sets
//! `relay_broker_blocked`; nothing is lost, and it resumes once the alarm clears. A batch the
//! block catches half written (lapin writes nothing more until the unblock) does not freeze the
//! relay: it still reports the block and stops when asked. A consumer whose retry copy the alarm
//! blocks goes on acknowledging everything else (its copies have a connection of their own).

use consumer::{Config, Handler, HandlerError, Handlers};
use serde_json::json;
use shared::{Envelope, NewMessage};
use sqlx::PgConnection;
use std::collections::HashSet;
use std::time::Duration;
use system_tests::consumers::{RunningConsumer, processed_rows};
use system_tests::fleet::{self, Component};
use system_tests::private_rabbit::RabbitNode;
use system_tests::*;

const LONG: Duration = Duration::from_secs(60);

/// A private node, a database, a queue collecting everything the relay publishes, a ready relay.
struct Setup {
    node: RabbitNode,
    db: TestDb,
    conn: lapin::Connection,
    rx: tokio::sync::mpsc::UnboundedReceiver<Received>,
    relay: Component,
    exchange: String,
}

impl Setup {
    async fn start(node_name: &str) -> Self {
        init_logging();
        let node = tokio::task::block_in_place(|| RabbitNode::start(node_name, &[]));
        let db = TestDb::new().await;
        let exchange = unique("outbox");
        let conn = plumbing::amqp::connect(&node.amqp_url(), &Default::default(), "test")
            .await
            .expect("connect to the private node");
        plumbing::amqp::declare_outbox_exchange(&conn, &exchange, true)
            .await
            .unwrap();
        let rx = collect_queue(&conn, &exchange, &unique("q"), &["#"]).await;
        let relay = Component::relay(&db.url, &node.amqp_url(), &exchange);
        relay.wait_ready("relay", LONG).await;
        Self {
            node,
            db,
            conn,
            rx,
            relay,
            exchange,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_waits_out_a_memory_alarm_and_loses_nothing() {
    let Setup {
        node,
        db,
        conn,
        mut rx,
        mut relay,
        ..
    } = Setup::start("alarm").await;

    assert!(fleet::enqueue_payments(&db.pool, 100, 10, 1).await);
    let mut got = receive_n(&mut rx, 100, LONG).await;

    // Memory alarm: the broker blocks every publishing connection.
    tokio::task::block_in_place(|| node.ctl(&["set_vm_memory_high_watermark", "0"]))
        .expect("raise the memory alarm");
    // The broker raises the alarm at its next memory check, and blocks a connection when it next
    // publishes: keep committing until the relay reports the block.
    let m = relay.metrics;
    let pool = db.pool.clone();
    wait_until("relay_broker_blocked 1", LONG, || {
        let pool = pool.clone();
        async move {
            assert!(fleet::enqueue_payments(&pool, 10, 10, 2).await);
            tokio::time::sleep(Duration::from_millis(100)).await;
            (fleet::metric(m, "relay_broker_blocked", &[]).await == Some(1.0)).then_some(())
        }
    })
    .await;
    wait_until("/readyz 503 while blocked", LONG, || async move {
        (http_status(m, "/readyz").await == Some(503)).then_some(())
    })
    .await;
    // While blocked, what is committed now stays in the outbox.
    assert!(fleet::enqueue_payments(&db.pool, 50, 10, 3).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        fleet::outbox_rows(&db.pool, "pending").await.unwrap() >= 50,
        "rows committed during the alarm were published while the broker blocked"
    );
    assert_eq!(
        fleet::metric(m, "relay_broker_blocked", &[]).await,
        Some(1.0)
    );

    tokio::task::block_in_place(|| node.ctl(&["set_vm_memory_high_watermark", "0.4"]))
        .expect("clear the memory alarm");
    relay.wait_ready("relay after the alarm", LONG).await;
    wait_until("relay_broker_blocked 0", LONG, || async move {
        (fleet::metric(m, "relay_broker_blocked", &[]).await == Some(0.0)).then_some(())
    })
    .await;
    let ids: Vec<String> = sqlx::query_scalar("SELECT id::text FROM outbox.messages")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let want: HashSet<String> = ids.into_iter().collect();
    assert!(want.len() >= 160);
    got.extend(receive_n(&mut rx, want.len() - got.len(), LONG).await);
    got.extend(drain(&mut rx, Duration::from_millis(500)).await);
    let seen: HashSet<String> = got.iter().map(|r| r.message_id.clone()).collect();
    assert_eq!(seen, want, "every committed message arrived");
    assert_eq!(fleet::outbox_rows(&db.pool, "pending").await, Some(0));
    assert!(relay.stop().await, "relay exits cleanly");
    let _ = conn.close(200, "done".into()).await;
}

/// The alarm is raised before a 32 MB batch is committed: the broker reads the first publish,
/// blocks the connection and reads nothing more, so the batch stays half written. The relay must
/// still report the block, and stop cleanly within its confirm timeout and grace when asked,
/// leaving the rest pending; a relay started after the alarm publishes all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_block_catches_half_written_neither_freezes_the_relay_nor_is_lost() {
    let Setup {
        node,
        db,
        conn,
        mut rx,
        mut relay,
        ..
    } = Setup::start("alarm-mid").await;

    tokio::task::block_in_place(|| node.ctl(&["set_vm_memory_high_watermark", "0"]))
        .expect("raise the memory alarm");
    wait_until("the memory alarm", LONG, || async {
        tokio::task::block_in_place(|| node.ctl(&["eval", "rabbit_alarm:get_alarms()."]))
            .ok()
            .filter(|alarms| alarms.contains("memory"))
    })
    .await;
    // Far more than the socket buffers of both ends hold: most of it waits in lapin.
    let blob = "x".repeat(512 * 1024);
    let rows: Vec<shared::NewMessage> = (0..64)
        .map(|i| {
            shared::NewMessage::new(
                "blob",
                format!("blob-{i}"),
                "blob.stored",
                serde_json::json!({ "data": blob }),
            )
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue_many(&mut *tx, &rows).await.unwrap();
    tx.commit().await.unwrap();

    let m = relay.metrics;
    wait_until(
        "relay_broker_blocked 1 with a batch half written",
        LONG,
        || async move {
            (fleet::metric(m, "relay_broker_blocked", &[]).await == Some(1.0)).then_some(())
        },
    )
    .await;
    wait_until("/readyz 503 while blocked", LONG, || async move {
        (http_status(m, "/readyz").await == Some(503)).then_some(())
    })
    .await;
    let asked = std::time::Instant::now();
    assert!(relay.stop().await, "the relay stops cleanly while blocked");
    // Confirm timeout 1.5 s, grace 5 s, closing the link 2 s (see the relay's shutdown).
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "stopping took {:?}",
        asked.elapsed()
    );
    let pending = fleet::outbox_rows(&db.pool, "pending").await.unwrap();
    assert!(
        pending >= 60,
        "what the broker did not read stays pending: {pending}"
    );

    tokio::task::block_in_place(|| node.ctl(&["set_vm_memory_high_watermark", "0.4"]))
        .expect("clear the memory alarm");
    relay.start();
    relay.wait_ready("relay after the alarm", LONG).await;
    wait_until("every row published", LONG, || {
        let pool = db.pool.clone();
        async move { (fleet::outbox_rows(&pool, "pending").await == Some(0)).then_some(()) }
    })
    .await;
    let ids: Vec<String> = sqlx::query_scalar("SELECT id::text FROM outbox.messages")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let want: HashSet<String> = ids.into_iter().collect();
    assert_eq!(want.len(), 64);
    // The first publish may have been read before the block, and is then delivered twice.
    let mut seen = HashSet::new();
    while seen.len() < want.len() {
        let more = receive_n(&mut rx, want.len() - seen.len(), LONG).await;
        seen.extend(more.into_iter().map(|r| r.message_id));
    }
    assert_eq!(seen, want, "every committed message arrived");
    assert!(relay.stop().await, "relay exits cleanly");
    let _ = conn.close(200, "done".into()).await;
}

/// Whether `node` has a memory alarm raised now.
fn memory_alarm(node: &RabbitNode) -> bool {
    tokio::task::block_in_place(|| node.ctl(&["eval", "rabbit_alarm:get_alarms()."]))
        .is_ok_and(|alarms| alarms.contains("memory"))
}

/// Fails the messages whose payload says `"mode": "down"`, transiently (a retry copy is
/// published for each); takes every other message.
struct DownIsDown;

impl Handler for DownIsDown {
    async fn handle(&self, _tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        if msg.payload["mode"] == json!("down") {
            return Err(HandlerError::transient("dependency is down"));
        }
        Ok(())
    }
}

/// During a memory alarm a consumer's first message fails and needs a retry copy, which the
/// broker blocks. Were the copy published on the consuming connection, the block would stop the
/// acks of every worker, and the consumer would stall at its prefetch. Copies have a connection
/// of their own: the other worker consumes and acknowledges all the rest during the alarm, in one
/// session, also past the 30 s a confirm otherwise gets; a stop during the alarm is not held up;
/// after the alarm every message is processed, and the failing one ends in the dead-letter queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_the_alarm_blocks_does_not_stop_the_consumers_acks() {
    let Setup {
        node,
        db,
        conn,
        rx: _rx,
        mut relay,
        exchange,
    } = Setup::start("alarm-consumer").await;
    let name = unique("alarmed");
    let mut config = Config::new(&name, node.amqp_url(), &exchange);
    config.workers = 2;
    config.prefetch = 20;
    config.batch_size = 10;
    config.max_attempts = 3;
    config.retry_delays = vec![Duration::from_millis(100)];
    let pool = plumbing::db::connect(&db.url, config.pool_size(), "alarm-consumer")
        .await
        .unwrap();
    let handlers = || Handlers::new().on("payment.captured", std::sync::Arc::new(DownIsDown));
    // Declares its queue, then stops: the backlog is published while nobody consumes.
    RunningConsumer::start(config.clone(), pool.clone(), handlers())
        .await
        .stop()
        .await;
    let down = NewMessage::new(
        "account",
        "acct-down",
        "payment.captured",
        json!({"mode": "down"}),
    );
    shared::outbox::enqueue(&db.pool, &down).await.unwrap();
    assert!(fleet::enqueue_payments(&db.pool, 300, 30, 7).await);
    wait_until("the backlog published before the alarm", LONG, || async {
        (fleet::outbox_rows(&db.pool, "pending").await == Some(0)).then_some(())
    })
    .await;

    tokio::task::block_in_place(|| node.ctl(&["set_vm_memory_high_watermark", "0"]))
        .expect("raise the memory alarm");
    wait_until("the memory alarm is raised", LONG, || async {
        memory_alarm(&node).then_some(())
    })
    .await;
    let running = RunningConsumer::start(config.clone(), pool.clone(), handlers()).await;
    // The failing message is the queue's head: its worker's retry copy is blocked at once, with
    // that worker's batch unacknowledged. Everything but that worker's prefetch is taken by the
    // other worker and acknowledged, during the alarm.
    wait_until("the rest processed during the alarm", LONG, || {
        let (pool, name) = (pool.clone(), name.clone());
        async move { (processed_rows(&pool, &name).await >= 280).then_some(()) }
    })
    .await;
    assert!(memory_alarm(&node), "still during the alarm");
    // In one session: not by giving up on the blocked copy's confirm and starting over.
    assert_eq!(running.stats.snapshot().reconnects, 0);
    // The blocked copy's confirm is waited for as long as the alarm lasts, past the 30 s a
    // confirm otherwise gets: the session is not restarted meanwhile.
    tokio::time::sleep(Duration::from_secs(32)).await;
    assert!(memory_alarm(&node), "still during the alarm");
    assert_eq!(running.stats.snapshot().reconnects, 0);
    // Asked to stop during the alarm, it stops: the blocked batch is left to redelivery.
    running.stop().await;

    tokio::task::block_in_place(|| node.ctl(&["set_vm_memory_high_watermark", "0.4"]))
        .expect("clear the memory alarm");
    let running = RunningConsumer::start(config, pool.clone(), handlers()).await;
    wait_until("all 300 processed after the alarm", LONG, || {
        let (pool, name) = (pool.clone(), name.clone());
        async move { (processed_rows(&pool, &name).await == 300).then_some(()) }
    })
    .await;
    // The failing message, whose batch the stop left to redelivery, is not lost either: retried
    // to its last attempt, it is in the dead-letter queue.
    let amqp = node.amqp_url();
    wait_until("the failing message dead-lettered", LONG, || {
        let (amqp, name) = (amqp.clone(), name.clone());
        async move {
            let depth = consumer::dlq::depth(&amqp, &Default::default(), &name).await;
            (depth.ok() == Some(1)).then_some(())
        }
    })
    .await;
    running.stop().await;
    assert!(relay.stop().await, "relay exits cleanly");
    let _ = conn.close(200, "done".into()).await;
}
