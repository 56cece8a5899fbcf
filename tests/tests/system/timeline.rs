//! `producer timeline`, the example consumer that records the order it applies events in
//! (`demo.timeline`), and `demo::timeline::violations` over its rows: outbox rows go through a
//! relay to the consumer as a child process, each applied exactly once, with its aggregate and
//! `aggregate_seq`. (Unordered mode: the test asserts nothing about order across workers.)

use consumer::Handler;
use demo::timeline::{TimelineHandler, Violations, violations};
use serde_json::json;
use shared::{Envelope, NewMessage};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;
use system_tests::consumers::{example_consumer_command, track_consumer};
use system_tests::relays::{InProcess, test_options};
use system_tests::*;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(60);
const RETRY_DELAYS: [Duration; 2] = [Duration::from_millis(100), Duration::from_millis(200)];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_appended_to_the_timeline_once_with_its_aggregate_and_seq() {
    init_logging();
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outbox");
    let name = unique("timeline");
    track_consumer(&broker, &name, &RETRY_DELAYS, None);

    let metrics = free_addr();
    let mut timeline =
        example_consumer_command("timeline", &name, &db.url, &amqp_url(), &exchange, metrics)
            .args(["--bind", "#", "--retry-delays", "100ms,200ms"])
            .spawn()
            .expect("spawn producer timeline");
    wait_http_ok("the timeline consumer is ready", metrics, "/readyz", LONG).await;
    let relay = InProcess::on(&db, &exchange, test_options()).await;

    // 50 events over 5 aggregates, in 5 producer transactions of 10.
    let events = spread("test", "thing.happened", "agg-", 5, 0..50);
    for chunk in events.chunks(10) {
        let mut tx = db.pool.begin().await.unwrap();
        shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }

    let pool = db.pool.clone();
    let consumer = name.clone();
    wait_until("demo.timeline has 50 rows", LONG, || {
        let (pool, consumer) = (pool.clone(), consumer.clone());
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM demo.timeline WHERE consumer = $1")
                    .bind(&consumer)
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (n >= 50).then_some(())
        }
    })
    .await;
    relay.stop().await;
    // SIGTERM: batches in flight finish (commit, then ack) before it exits 0, so a late second
    // application would be in the table by now.
    signals::sigterm(&timeline);
    let status = tokio::time::timeout(LONG, timeline.wait())
        .await
        .expect("producer timeline exits in time")
        .unwrap();
    assert!(status.success(), "producer timeline exit status {status:?}");

    let rows: Vec<(Uuid, String, String, Option<i64>, String)> = sqlx::query_as(
        "SELECT message_id, aggregate_type, aggregate_id, aggregate_seq, event_type \
         FROM demo.timeline WHERE consumer = $1 ORDER BY position",
    )
    .bind(&name)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut times: HashMap<Uuid, usize> = HashMap::new();
    for row in &rows {
        *times.entry(row.0).or_default() += 1;
    }
    for e in &events {
        assert_eq!(
            times.remove(&e.id),
            Some(1),
            "message {} must be in the timeline exactly once",
            e.id
        );
    }
    assert!(times.is_empty(), "rows of messages never sent: {times:?}");

    // Each row carries its aggregate and event type, and each aggregate's ten events their
    // numbers 1..=10 (in whatever order unordered workers applied them).
    let mut seqs: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    for (_, aggregate_type, aggregate_id, seq, event_type) in rows {
        assert_eq!(aggregate_type, "test");
        assert_eq!(event_type, "thing.happened");
        seqs.entry(aggregate_id)
            .or_default()
            .insert(seq.expect("the relay sets aggregate_seq"));
    }
    let want: BTreeMap<String, BTreeSet<i64>> = (0..5)
        .map(|a| (format!("agg-{a}"), (1..=10).collect()))
        .collect();
    assert_eq!(seqs, want);

    let v = violations(&db.pool, &name).await.unwrap();
    assert_eq!(v.applied_twice, 0, "{v:?}");
}

/// `violations` on rows written by hand: steps backwards or in place within an aggregate count,
/// other aggregates and other consumers do not, a NULL seq is not compared, and each message with
/// more than one row counts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn violations_counts_steps_back_and_repeated_messages_of_one_consumer() {
    let db = TestDb::new().await;
    let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    // (consumer, aggregate_id, aggregate_seq, message_id), in position order.
    let rows: Vec<(&str, &str, Option<i64>, Uuid)> = vec![
        ("me", "x", Some(1), Uuid::now_v7()),
        ("me", "y", Some(5), Uuid::now_v7()), // another aggregate: no effect on x
        ("me", "x", Some(3), a),
        ("me", "x", Some(2), Uuid::now_v7()), // out of order (2 after 3)
        ("me", "x", Some(3), a),              // a again: applied twice (3 after 2 is in order)
        ("me", "x", Some(3), b),              // out of order (3 again)
        ("me", "x", None, c),                 // not compared
        ("me", "x", Some(1), c),              // after a NULL: not compared; applied twice (c)
        ("other", "x", Some(1), a),           // another consumer
        ("other", "x", Some(1), a),
    ];
    for (consumer, aggregate_id, seq, id) in rows {
        sqlx::query(
            "INSERT INTO demo.timeline \
             (consumer, aggregate_type, aggregate_id, aggregate_seq, message_id, event_type) \
             VALUES ($1, 'test', $2, $3, $4, 'thing.happened')",
        )
        .bind(consumer)
        .bind(aggregate_id)
        .bind(seq)
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    assert_eq!(
        violations(&db.pool, "me").await.unwrap(),
        Violations {
            out_of_order: 2,
            applied_twice: 2,
        }
    );
    assert_eq!(
        violations(&db.pool, "other").await.unwrap(),
        Violations {
            out_of_order: 1,
            applied_twice: 1,
        }
    );
    assert_eq!(
        violations(&db.pool, "nobody").await.unwrap(),
        Violations::default()
    );
}

fn envelope(aggregate_id: &str, seq: Option<i64>) -> Envelope {
    Envelope {
        message_id: Uuid::now_v7(),
        event_type: "thing.happened".into(),
        aggregate_type: "test".into(),
        aggregate_id: aggregate_id.into(),
        aggregate_seq: seq,
        created_at: None,
        headers: Default::default(),
        payload: json!({}),
    }
}

/// A batch is appended in the order of its slice (which is not the order of the seqs here), a
/// missing seq as NULL; `handle` appends one row after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_appended_in_slice_order() {
    let db = TestDb::new().await;
    let handler = TimelineHandler {
        consumer: "me".into(),
    };
    let batch = [
        envelope("x", Some(3)),
        envelope("y", None),
        envelope("x", Some(1)),
        envelope("x", Some(2)),
    ];
    let single = envelope("y", Some(7));
    let mut tx = db.pool.begin().await.unwrap();
    let refs: Vec<&Envelope> = batch.iter().collect();
    handler.handle_batch(&mut tx, &refs).await.unwrap();
    handler.handle(&mut tx, &single).await.unwrap();
    tx.commit().await.unwrap();

    let rows: Vec<(Uuid, String, Option<i64>)> = sqlx::query_as(
        "SELECT message_id, aggregate_id, aggregate_seq FROM demo.timeline \
         WHERE consumer = 'me' ORDER BY position",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let want: Vec<(Uuid, String, Option<i64>)> = batch
        .iter()
        .chain([&single])
        .map(|e| (e.message_id, e.aggregate_id.clone(), e.aggregate_seq))
        .collect();
    assert_eq!(rows, want);
    assert_eq!(
        violations(&db.pool, "me").await.unwrap(),
        Violations {
            out_of_order: 1,
            applied_twice: 0,
        }
    );
}

/// `producer timeline --ordered`, two instances as child processes: one is SIGKILLed mid-stream;
/// the other takes its partitions over after the lease, and the timeline shows every event
/// applied once and each aggregate in order. A third joins and gets its share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_instances_keep_each_aggregate_in_order_across_a_sigkill_and_a_join() {
    init_logging();
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outbox");
    let name = unique("otl");
    track_consumer(&broker, &name, &[], Some(4));
    let spawn = || {
        let metrics = free_addr();
        let child =
            example_consumer_command("timeline", &name, &db.url, &amqp_url(), &exchange, metrics)
                .args(["--ordered", "--partitions", "4"])
                .args(["--lease", "2s", "--batch-size", "50"])
                .spawn()
                .expect("spawn producer timeline --ordered");
        (child, metrics)
    };
    let (mut first, m1) = spawn();
    let (mut second, m2) = spawn();
    for m in [m1, m2] {
        wait_http_ok("an ordered timeline instance is ready", m, "/readyz", LONG).await;
    }
    let relay = InProcess::on(&db, &exchange, test_options()).await;
    let owners = |pool: sqlx::PgPool, name: String| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox.consumer_partitions WHERE consumer = $1 \
             AND owner IS NOT NULL AND lease_until > now() GROUP BY owner ORDER BY 1 DESC",
        )
        .bind(name)
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    wait_until("two instances hold 2 partitions each", LONG, || {
        let f = owners(db.pool.clone(), name.clone());
        async move { (f.await == vec![2, 2]).then_some(()) }
    })
    .await;

    // 800 events: a hot aggregate with half of them, the rest over 20 others, in 8 transactions.
    let events: Vec<NewMessage> = (0..800)
        .map(|n| {
            let aggregate = if n % 2 == 0 {
                "hot".to_string()
            } else {
                format!("agg-{}", n % 20)
            };
            NewMessage::new("test", aggregate, "thing.happened", json!({ "n": n }))
        })
        .collect();
    let count = |pool: sqlx::PgPool, name: String| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM demo.timeline WHERE consumer = $1")
            .bind(name)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    for (i, chunk) in events.chunks(100).enumerate() {
        let mut tx = db.pool.begin().await.unwrap();
        shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
        if i == 3 {
            // Mid-stream: kill the first instance (no goodbye, its leases just end).
            wait_until("some events applied", LONG, || {
                let f = count(db.pool.clone(), name.clone());
                async move { (f.await >= 100).then_some(()) }
            })
            .await;
            first.start_kill().unwrap();
            let _ = first.wait().await;
        }
    }
    let killed_at = std::time::Instant::now();
    wait_until("the survivor holds all 4 partitions", LONG, || {
        let f = owners(db.pool.clone(), name.clone());
        async move { (f.await == vec![4]).then_some(()) }
    })
    .await;
    println!("rebalanced after SIGKILL in {:?}", killed_at.elapsed());
    // A third instance joins: the spread becomes 2/1... within a few heartbeats.
    let (_third, m3) = spawn();
    let joined_at = std::time::Instant::now();
    wait_http_ok("the third instance is ready", m3, "/readyz", LONG).await;
    wait_until(
        "the partitions spread 2, 2 over two live instances",
        LONG,
        || {
            let f = owners(db.pool.clone(), name.clone());
            async move { (f.await == vec![2, 2]).then_some(()) }
        },
    )
    .await;
    println!("rebalanced after a join in {:?}", joined_at.elapsed());
    wait_until("every event in the timeline", LONG, || {
        let f = count(db.pool.clone(), name.clone());
        async move { (f.await >= 800).then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.stop().await;
    let v = violations(&db.pool, &name).await.unwrap();
    assert_eq!(
        v,
        Violations::default(),
        "order violations or effects applied twice"
    );
    let applied: i64 = count(db.pool.clone(), name.clone()).await;
    assert_eq!(applied, 800, "each event exactly once");
    // A stopping instance hands its partitions over at once (no lease to wait out), and exits 0.
    let stopping_at = std::time::Instant::now();
    let status = signals::sigterm_and_wait(&mut second, LONG).await;
    assert!(status.success(), "a graceful stop exits 0: {status:?}");
    wait_until("the last instance holds all 4 partitions", LONG, || {
        let f = owners(db.pool.clone(), name.clone());
        async move { (f.await == vec![4]).then_some(()) }
    })
    .await;
    println!(
        "rebalanced after a graceful stop in {:?}",
        stopping_at.elapsed()
    );
}
