//! RabbitMQ resource alarms on a node of the test's own: when the broker blocks publishers
//! (`connection.blocked`), the relay stops publishing, answers /readyz 503 and sets
//! `relay_broker_blocked`; nothing is lost, and it resumes once the alarm clears.

use std::collections::HashSet;
use std::time::Duration;
use system_tests::fleet::{self, Component};
use system_tests::private_rabbit::RabbitNode;
use system_tests::*;

const LONG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_waits_out_a_memory_alarm_and_loses_nothing() {
    init_logging();
    let node = tokio::task::block_in_place(|| RabbitNode::start("alarm", &[]));
    let db = TestDb::new().await;
    let exchange = unique("outbox");
    let conn = plumbing::amqp::connect(&node.amqp_url(), &Default::default(), "test")
        .await
        .expect("connect to the private node");
    plumbing::amqp::declare_outbox_exchange(&conn, &exchange, true)
        .await
        .unwrap();
    let mut rx = collect_queue(&conn, &exchange, &unique("q"), &["#"]).await;
    let mut relay = Component::relay(&db.url, &node.amqp_url(), &exchange);
    relay.wait_ready("relay", LONG).await;

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
