//! A 3-node RabbitMQ cluster of the test's own: the relay and the ledger consumer take the node
//! list in `AMQP_URL`; each node in turn (the queue's quorum leader first) is SIGKILLed while
//! payments flow, and everything committed is applied exactly once while it is down.

use std::time::Duration;
use system_tests::fleet::{self, Component};
use system_tests::private_rabbit::{self, RabbitNode};
use system_tests::*;

const LONG: Duration = Duration::from_secs(120);

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Waits until the ledger shows every committed payment, never more; on timeout, panics with
/// what the outbox, the ledger and the queues show.
async fn wait_applied(pool: &sqlx::PgPool, nodes: &[RabbitNode], what: &str) {
    let deadline = std::time::Instant::now() + LONG;
    loop {
        let pending = fleet::outbox_rows(pool, "pending").await.unwrap_or(-1);
        let published = fleet::outbox_rows(pool, "published").await.unwrap_or(-1);
        let dead = fleet::outbox_rows(pool, "dead").await.unwrap_or(-1);
        let u = fleet::total_updates(pool).await.unwrap_or(-1);
        assert!(u <= pending + published, "{u} updates: applied twice");
        if pending == 0 && u == published {
            return;
        }
        if std::time::Instant::now() >= deadline {
            let queues: Vec<String> = nodes
                .iter()
                .filter(|n| n.is_running())
                .take(1)
                .map(|n| {
                    n.ctl(&[
                        "list_queues",
                        "name",
                        "type",
                        "messages",
                        "consumers",
                        "leader",
                    ])
                    .unwrap_or_else(|e| e)
                })
                .collect();
            panic!(
                "timed out waiting for {what}: {pending} pending, {published} published, {dead} dead, {u} applied; queues: {queues:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn index_of(nodes: &[RabbitNode], node: &str) -> Option<usize> {
    nodes.iter().position(|n| n.node == node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_fail_over_between_cluster_nodes() {
    init_logging();
    let mut nodes = blocking(|| private_rabbit::start_cluster(&["fa", "fb", "fc"], &[]));
    let list = nodes
        .iter()
        .map(|n| n.amqp_url())
        .collect::<Vec<_>>()
        .join(",");
    let db = TestDb::new().await;
    let exchange = unique("outbox");
    let name = unique("ledger");
    let mut consumer = Component::ledger(&db.url, &list, &exchange, &name);
    consumer.wait_ready("consumer", LONG).await;
    let mut relay = Component::relay(&db.url, &list, &exchange);
    relay.wait_ready("relay", LONG).await;

    assert!(fleet::enqueue_payments(&db.pool, 200, 20, 1).await);
    wait_applied(&db.pool, &nodes, "the first payments").await;

    // The leader of the consumer's quorum queue dies first, then the others in turn.
    let leader = blocking(|| nodes[0].quorum_leader(&name)).expect("the queue has a leader");
    let first = index_of(&nodes, &leader).expect("the leader is one of the nodes");
    for round in 0..3u64 {
        let victim = (first + round as usize) % nodes.len();
        blocking(|| nodes[victim].kill());
        for i in 0..5 {
            assert!(fleet::enqueue_payments(&db.pool, 100, 20, 10 * round + i).await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let what = format!("payments while {} is down", nodes[victim].node);
        wait_applied(&db.pool, &nodes, &what).await;
        blocking(|| nodes[victim].start_again());
    }
    assert!(fleet::enqueue_payments(&db.pool, 200, 20, 99).await);
    wait_applied(&db.pool, &nodes, "the last payments").await;

    assert_eq!(
        fleet::ledger(&db.pool).await,
        fleet::expected_ledger(&db.pool).await,
        "every payment applied exactly once"
    );
    assert!(relay.stop().await, "relay exits cleanly");
    assert!(consumer.stop().await, "consumer exits cleanly");
}
