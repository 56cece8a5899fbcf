//! Per-aggregate sequence numbers (assigned in the producer's transaction) and what a queue sees
//! of them when the relay pipelines many rows of one aggregate: in order without failures, and as
//! the README's table "What a consumer can observe" says when the broker nacks in the middle of a
//! pipeline. (Returns, link cuts and a killed relay are checked in relay.rs, a channel closed by
//! the broker in hostile_rows.rs.)

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use relay::RelayOptions;
use serde_json::json;
use shared::NewMessage;
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;
use system_tests::ordering::{Observed, aggregate_seq};
use system_tests::relays::{InProcess, patient_options, test_options};
use system_tests::*;

fn msg(aggregate: &str, n: i64) -> NewMessage {
    NewMessage::new(
        "test",
        aggregate,
        "thing.happened",
        json!({ "aggregate": aggregate, "n": n }),
    )
}

async fn seqs_of(pool: &sqlx::PgPool, aggregate: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT aggregate_seq FROM outbox.messages WHERE aggregate_id = $1 ORDER BY seq",
    )
    .bind(aggregate)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_gets_a_dense_number_per_aggregate_and_a_rollback_leaves_no_gap() {
    let db = TestDb::new().await;
    // Plain SQL, as any language writes it: no number given, one assigned.
    for aggregate in ["a", "b", "a"] {
        sqlx::query(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('test', $1, 'thing.happened', '{}')",
        )
        .bind(aggregate)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // A rolled-back transaction takes no number for good.
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue(&mut *tx, &msg("a", 9))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // A number given by the producer is replaced; a batch numbers its rows in order.
    sqlx::query(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, aggregate_seq) \
         VALUES ('test', 'a', 'thing.happened', '{}', 1000)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let batch: Vec<NewMessage> = (0..5)
        .map(|n| msg(if n % 2 == 0 { "a" } else { "b" }, n))
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue_many(&mut *tx, &batch)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    assert_eq!(seqs_of(&db.pool, "a").await, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(seqs_of(&db.pool, "b").await, vec![1, 2, 3]);
    // The same id under another aggregate type is another aggregate.
    sqlx::query(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('other', 'a', 'thing.happened', '{}')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let other: i64 = sqlx::query_scalar(
        "SELECT aggregate_seq FROM outbox.messages WHERE aggregate_type = 'other'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(other, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_transaction_on_one_aggregate_waits_and_commits_after_the_first() {
    let db = TestDb::new().await;
    let mut first = db.pool.begin().await.unwrap();
    shared::outbox::enqueue(&mut *first, &msg("hot", 1))
        .await
        .unwrap();

    // Another aggregate does not wait.
    tokio::time::timeout(
        Duration::from_secs(5),
        shared::outbox::enqueue(&db.pool, &msg("cold", 1)),
    )
    .await
    .expect("a producer on another aggregate never waits")
    .unwrap();

    // The same aggregate waits for the first transaction's end, with no call from the producer.
    let pool = db.pool.clone();
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        shared::outbox::enqueue(&mut *tx, &msg("hot", 2))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !second.is_finished(),
        "the second writer of 'hot' must wait"
    );
    first.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the second writer goes on after the first commit")
        .unwrap();

    // Numbers follow commit order, and so does the outbox position the relay claims by.
    let rows: Vec<(i64, i64, serde_json::Value)> = sqlx::query_as(
        "SELECT seq, aggregate_seq, payload FROM outbox.messages WHERE aggregate_id = 'hot' ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let numbers: Vec<(i64, i64)> = rows
        .iter()
        .map(|(_, a, p)| (*a, p["n"].as_i64().unwrap()))
        .collect();
    assert_eq!(numbers, vec![(1, 1), (2, 2)]);
}

/// Numbers of `aggregate` in `schema`, in outbox order.
async fn seqs_in(pool: &sqlx::PgPool, schema: &str, aggregate: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT aggregate_seq FROM {schema}.messages WHERE aggregate_id = $1 ORDER BY seq"
    )))
    .bind(aggregate)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn insert_in(conn: &mut sqlx::PgConnection, schema: &str, aggregate: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {schema}.messages (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('test', $1, 'thing.happened', '{{}}')"
    )))
    .bind(aggregate)
    .execute(conn)
    .await
    .unwrap();
}

/// Two installations (schemas) written in one transaction, in every interleaving that leaves one
/// schema's counter behind in the transaction's cache: the next transactions continue both counts
/// with no number handed out twice. (Migration 8 lost the first schema's counter update here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schemas_in_one_transaction_keep_both_counts() {
    let db = TestDb::new().await;
    let second = shared::schema::Schema::new("second_outbox").unwrap();
    shared::migrate::run(&db.pool, &second).await.unwrap();
    let schemas = ["outbox", "second_outbox"];
    for (first, other) in [(0, 1), (1, 0)] {
        let (a, b) = (schemas[first], schemas[other]);
        let mut tx = db.pool.begin().await.unwrap();
        insert_in(&mut tx, a, "k").await;
        insert_in(&mut tx, a, "k").await; // a's counter is now behind, its number cached
        insert_in(&mut tx, b, "k").await;
        insert_in(&mut tx, b, "k").await;
        insert_in(&mut tx, a, "k").await;
        insert_in(&mut tx, a, "j").await; // a's own switch writes k's counter
        insert_in(&mut tx, b, "k").await; // b takes the cache over from a current entry
        insert_in(&mut tx, b, "k").await; // and leaves its own counter behind at commit
        tx.commit().await.unwrap();
        let mut conn = db.pool.acquire().await.unwrap();
        insert_in(&mut conn, a, "k").await;
        insert_in(&mut conn, b, "k").await;
    }
    for schema in schemas {
        assert_eq!(
            seqs_in(&db.pool, schema, "k").await,
            (1..=9).collect::<Vec<i64>>(),
            "{schema}: dense, each number once"
        );
        assert_eq!(seqs_in(&db.pool, schema, "j").await, vec![1]);
    }
}

/// A row that repeats a message id takes no number: `ON CONFLICT (id) DO NOTHING` leaves no gap,
/// and a plain INSERT still fails on the unique id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_message_id_takes_no_number() {
    let db = TestDb::new().await;
    let id = uuid::Uuid::new_v4();
    let insert = "INSERT INTO outbox.messages (id, aggregate_type, aggregate_id, event_type, payload) \
                  VALUES ($1, 'test', 'r', 'thing.happened', '{}')";
    sqlx::query(insert)
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    for _ in 0..3 {
        let skipped = sqlx::query(sqlx::AssertSqlSafe(format!(
            "{insert} ON CONFLICT (id) DO NOTHING"
        )))
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
        assert_eq!(skipped.rows_affected(), 0);
    }
    let refused = sqlx::query(insert).bind(id).execute(&db.pool).await;
    let code = refused
        .expect_err("a repeated id is refused")
        .as_database_error()
        .and_then(|e| e.code().map(|c| c.to_string()));
    assert_eq!(
        code.as_deref(),
        Some("23505"),
        "a unique violation, as before"
    );
    // In a transaction with other rows of the aggregate, and in a batch.
    let mut tx = db.pool.begin().await.unwrap();
    insert_in(&mut tx, "outbox", "r").await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "{insert} ON CONFLICT (id) DO NOTHING"
    )))
    .bind(id)
    .execute(&mut *tx)
    .await
    .unwrap();
    insert_in(&mut tx, "outbox", "r").await;
    // The repeated id on another aggregate, while r's counter is behind in the cache: the row is
    // numbered from a counter (writing r's first), and neither count moves.
    sqlx::query(
        "INSERT INTO outbox.messages (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'test', 's', 'thing.happened', '{}') ON CONFLICT (id) DO NOTHING",
    )
    .bind(id)
    .execute(&mut *tx)
    .await
    .unwrap();
    insert_in(&mut tx, "outbox", "r").await;
    tx.commit().await.unwrap();
    insert_in(&mut db.pool.acquire().await.unwrap(), "outbox", "r").await;
    insert_in(&mut db.pool.acquire().await.unwrap(), "outbox", "s").await;
    assert_eq!(seqs_of(&db.pool, "r").await, vec![1, 2, 3, 4, 5]);
    assert_eq!(
        seqs_of(&db.pool, "s").await,
        vec![1],
        "no number of s was used up"
    );
}

/// The commit-time counter write is queued once per transaction; a flush forced early
/// (`SET CONSTRAINTS ALL IMMEDIATE`) and a rolled-back savepoint must still leave the counter
/// right for the next transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counter_is_written_after_an_early_flush_and_a_rolled_back_savepoint() {
    let db = TestDb::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    for _ in 0..3 {
        insert_in(&mut tx, "outbox", "f").await;
    }
    sqlx::query("SET CONSTRAINTS ALL IMMEDIATE")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SET CONSTRAINTS ALL DEFERRED")
        .execute(&mut *tx)
        .await
        .unwrap();
    for _ in 0..3 {
        insert_in(&mut tx, "outbox", "f").await; // numbers 4..6, counter behind again
    }
    sqlx::query("SAVEPOINT s").execute(&mut *tx).await.unwrap();
    for _ in 0..2 {
        insert_in(&mut tx, "outbox", "f").await;
    }
    insert_in(&mut tx, "outbox", "g").await;
    sqlx::query("ROLLBACK TO SAVEPOINT s")
        .execute(&mut *tx)
        .await
        .unwrap();
    insert_in(&mut tx, "outbox", "f").await; // 7
    tx.commit().await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    insert_in(&mut conn, "outbox", "f").await; // 8
    insert_in(&mut conn, "outbox", "g").await; // 1
    assert_eq!(seqs_of(&db.pool, "f").await, (1..=8).collect::<Vec<i64>>());
    assert_eq!(seqs_of(&db.pool, "g").await, vec![1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_numbers_pending_rows_and_refuses_the_names_it_reserves() {
    let db = TestDb::new_unmigrated().await;
    let schema = shared::schema::Schema::default();
    shared::migrate::migrator(&schema)
        .run_to(7, &db.pool)
        .await
        .unwrap();
    for (aggregate, headers) in [
        ("a", json!({})),
        ("b", json!({})),
        ("a", json!({})),
        ("a", json!({"cloudEvents_type": "x"})),
    ] {
        sqlx::query(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ('test', $1, 'thing.happened', '{}', $2)",
        )
        .bind(aggregate)
        .bind(headers)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    shared::migrate::run(&db.pool, &schema).await.unwrap();
    assert_eq!(seqs_of(&db.pool, "a").await, vec![1, 2, 3]);
    assert_eq!(seqs_of(&db.pool, "b").await, vec![1]);
    let dead: Vec<String> =
        sqlx::query_scalar("SELECT last_error FROM outbox.messages WHERE state = 'dead'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(dead.len(), 1, "the row using a newly reserved name");
    assert!(dead[0].contains("reserved"), "{}", dead[0]);
    // The next message continues each aggregate's count.
    shared::outbox::enqueue(&db.pool, &msg("a", 4))
        .await
        .unwrap();
    assert_eq!(seqs_of(&db.pool, "a").await, vec![1, 2, 3, 4]);
    // The door refuses the reserved names, in any case.
    for name in ["aggregate_seq", "CLOUDEVENTS_ID", "cloudEvents:type"] {
        let refused = sqlx::query(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ('test', 'a', 'e', '{}', jsonb_build_object($1::text, 'x'))",
        )
        .bind(name)
        .execute(&db.pool)
        .await;
        assert!(refused.is_err(), "{name} must be refused");
        let rust = msg("a", 5).with_header(name, "x").check();
        assert!(rust.is_err(), "{name} must be refused by the Rust API too");
    }
}

/// A queue bound to everything, declared with `arguments`; deliveries acked as they arrive, after
/// `delay` each (a slow consumer).
async fn consume(
    conn: &lapin::Connection,
    exchange: &str,
    queue: &str,
    arguments: FieldTable,
    delay: Duration,
) -> tokio::sync::mpsc::UnboundedReceiver<Received> {
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let ch = declare_bound_queue(conn, exchange, queue, &["#"], exclusive, arguments).await;
    forward_deliveries(ch, queue, 1, Some(delay)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hot_aggregate_is_published_with_many_in_flight_once_each_in_order() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(false).await;
    let queue = unique("q"); // exclusive: gone with its connection
    let mut rx = consume(
        &conn,
        &exchange,
        &queue,
        FieldTable::default(),
        Duration::ZERO,
    )
    .await;
    let all: Vec<NewMessage> = (0..3000).map(|n| msg("hot", n)).collect();
    for chunk in all.chunks(500) {
        let mut tx = db.pool.begin().await.unwrap();
        shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
    let relay = InProcess::on(&db, &exchange, patient_options()).await;
    let want: HashSet<String> = all.iter().map(|m| m.id.to_string()).collect();
    let received = receive_all_of(&mut rx, &want, Duration::from_secs(60)).await;
    relay.stop().await;
    let seqs: Vec<i64> = received.iter().filter_map(aggregate_seq).collect();
    assert_eq!(
        seqs,
        (1..=3000).collect::<Vec<i64>>(),
        "once each, in order"
    );
}

/// The README's table, "nacked": a queue with `x-max-length` and `x-overflow: reject-publish`
/// nacks publishes while it is full, in the middle of a pipeline of one aggregate. A row arrives
/// behind a later one only if it was nacked, every row's last copy is in order, and nothing is
/// lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacks_in_the_middle_of_a_pipeline_keep_every_last_copy_in_order() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(false).await;
    let queue = unique("full"); // exclusive: gone with its connection
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(20));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let mut rx = consume(&conn, &exchange, &queue, args, Duration::from_millis(2)).await;

    let mut all = Vec::new();
    for n in 0..400 {
        all.push(msg("hot", n));
        if n % 10 == 0 {
            all.push(msg(&format!("cold-{n}"), 0));
        }
    }
    for chunk in all.chunks(100) {
        let mut tx = db.pool.begin().await.unwrap();
        shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
    let opts = RelayOptions {
        max_attempts: 1_000,
        retention_secs: 3600, // keep published rows, so their attempts show which were nacked
        // Nacks, not timeouts, are this test's subject: a loaded machine must not time a confirm
        // out (a link failure sends unconfirmed rows again uncharged, so a refusal among them
        // would not show in `attempts`).
        confirm_timeout_ms: 15_000,
        lease_ms: 40_000,
        ..test_options()
    };
    let relay = InProcess::on(&db, &exchange, opts).await;
    let want: HashSet<String> = all.iter().map(|m| m.id.to_string()).collect();
    let mut received = receive_all_of(&mut rx, &want, Duration::from_secs(120)).await;
    // Copies sent again after a refusal may still be on their way: wait until every row is
    // marked, then for the queue to go quiet.
    wait_no_pending(&db.pool, Duration::from_secs(60)).await;
    received.extend(drain(&mut rx, Duration::from_millis(1500)).await);
    relay.stop().await;

    let refused: HashSet<(String, i64)> = sqlx::query_as::<_, (String, i64)>(
        "SELECT aggregate_id, aggregate_seq FROM outbox.messages WHERE attempts > 0",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert!(!refused.is_empty(), "the full queue nacked some publishes");
    let observed = Observed::new(&received);
    eprintln!(
        "nacked: {} rows charged, {} copies; hot: {}",
        refused.len(),
        observed.copies(),
        observed.pattern("hot")
    );
    observed.assert_overtaken_only_by_refusals(&refused);
    let mut expected: BTreeMap<String, i64> = BTreeMap::from([("hot".to_string(), 400)]);
    for n in (0..400).step_by(10) {
        expected.insert(format!("cold-{n}"), 1);
    }
    observed.assert_complete(&expected, &HashSet::new());
}

/// Migration 26: a new aggregate's counter row is inserted with first_seq 1, and every aggregate
/// keeps that row when the purge deletes its other closed rows. A producer at REPEATABLE READ whose
/// snapshot predates the aggregate finds no row in it; its insert of number 1 must conflict with
/// the kept row and fail with a serialization failure, never hand out 1 again. The retry goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeatable_read_producer_whose_snapshot_predates_the_aggregate_retries_and_reuses_no_number()
 {
    let db = TestDb::new().await;
    let schema = shared::schema::Schema::default();
    let mut rr = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *rr)
        .await
        .unwrap();
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.messages")
        .fetch_one(&mut *rr)
        .await
        .unwrap();
    assert_eq!(seen, 0, "the snapshot predates the aggregate");
    // 40 transactions: the aggregate's first row takes 32 updates, is closed, a second goes on.
    for n in 1..=40 {
        shared::outbox::enqueue(&db.pool, &msg("rr", n))
            .await
            .unwrap();
    }
    let closed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.aggregate_sequences WHERE aggregate_id = 'rr' AND closed",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(closed, 1, "the first row was closed after 32 updates");
    let stop = tokio_util::sync::CancellationToken::new();
    relay::counters::pass(&db.pool, &schema, &stop)
        .await
        .unwrap();
    let refused = shared::outbox::enqueue(&mut *rr, &msg("rr", 41))
        .await
        .expect_err("number 1 again would be a second message at position 1");
    let code = match &refused {
        shared::outbox::EnqueueError::Database(e) => e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.to_string()),
        other => panic!("{other}"),
    };
    assert_eq!(code.as_deref(), Some("40001"), "{refused}");
    rr.rollback().await.unwrap();
    let mut retry = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *retry)
        .await
        .unwrap();
    shared::outbox::enqueue(&mut *retry, &msg("rr", 41))
        .await
        .unwrap();
    retry.commit().await.unwrap();
    assert_eq!(
        seqs_of(&db.pool, "rr").await,
        (1..=41).collect::<Vec<i64>>()
    );
}

/// Migration 26 under contention: producers on a few aggregates, transactions of several rows
/// (the cache and its flush), some rolled back, so that counter rows fill and close many times,
/// while the counter purge runs without pause. Every aggregate's numbers are 1..n once each, in
/// outbox order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producers_and_the_counter_purge_together_keep_every_aggregate_dense() {
    let db = TestDb::new().await;
    let schema = shared::schema::Schema::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let purge = {
        let (pool, schema, stop) = (db.pool.clone(), schema.clone(), stop.clone());
        tokio::spawn(async move {
            let mut passes = 0;
            while !stop.is_cancelled() {
                relay::counters::pass(&pool, &schema, &stop).await.unwrap();
                passes += 1;
            }
            passes
        })
    };
    let producers: Vec<_> = (0..6)
        .map(|p| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                for i in 0..150i64 {
                    let mut tx = pool.begin().await.unwrap();
                    // In one order of aggregates, so transactions wait for each other but never
                    // deadlock (README: a producer writing A then B beside one writing B then A
                    // gets 40P01).
                    let mut aggs: Vec<String> = (0..(1 + (i + p) % 3))
                        .map(|r| format!("dense-{}", (i + r) % 4))
                        .collect();
                    aggs.sort();
                    for agg in &aggs {
                        shared::outbox::enqueue(&mut *tx, &msg(agg, i))
                            .await
                            .unwrap();
                    }
                    if i % 10 == 7 {
                        tx.rollback().await.unwrap();
                    } else {
                        tx.commit().await.unwrap();
                    }
                }
            })
        })
        .collect();
    for p in producers {
        p.await.unwrap();
    }
    stop.cancel();
    let passes = purge.await.unwrap();
    assert!(passes > 1, "the purge ran alongside ({passes} passes)");
    for a in 0..4 {
        let seqs = seqs_of(&db.pool, &format!("dense-{a}")).await;
        let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert!(!seqs.is_empty());
        assert_eq!(
            seqs, expected,
            "dense-{a}: dense, once each, in outbox order"
        );
    }
}

/// Migration 26 on an installed outbox: counters written by the update-in-place numbering (up to
/// migration 25) go on without a gap or a repeat once it ran, through the closing of their row
/// (their 33rd number after the upgrade), and a new aggregate starts at 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_from_before_migration_26_go_on_through_the_upgrade_and_their_row_closing() {
    let db = TestDb::new_unmigrated().await;
    let schema = shared::schema::Schema::default();
    shared::migrate::run_to(&db.pool, &schema, 25)
        .await
        .unwrap();
    for n in 1..=40 {
        shared::outbox::enqueue(&db.pool, &msg("installed", n))
            .await
            .unwrap();
    }
    shared::migrate::run(&db.pool, &schema).await.unwrap();
    for n in 41..=80 {
        shared::outbox::enqueue(&db.pool, &msg("installed", n))
            .await
            .unwrap();
    }
    shared::outbox::enqueue(&db.pool, &msg("fresh", 1))
        .await
        .unwrap();
    let closed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.aggregate_sequences WHERE aggregate_id = 'installed' AND closed",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        closed, 1,
        "the row from before the upgrade filled and was closed"
    );
    assert_eq!(
        seqs_of(&db.pool, "installed").await,
        (1..=80).collect::<Vec<i64>>()
    );
    assert_eq!(seqs_of(&db.pool, "fresh").await, vec![1]);
}
