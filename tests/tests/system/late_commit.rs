//! Nothing is skipped when the relay has moved past a row's position before the row commits
//! (issue 39). The claim reads each partition past the position it has passed; a producer's
//! transaction that took its seqs before later rows were published, and commits minutes later,
//! must still be published, in its aggregate's order. Two relays share the partitions, and an old
//! snapshot is held meanwhile (the condition the positions exist for).

use std::collections::HashMap;
use std::time::Duration;
use system_tests::relays::{InProcess, test_options};
use system_tests::{TestBroker, TestDb, collect_queue, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rows_that_commit_late_below_the_relays_position_are_published_in_their_aggregates_order() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(true).await;
    let queue = broker.queue("late");
    let mut rx = collect_queue(&conn, &exchange, &queue, &["#"]).await;
    let one = InProcess::on(&db, &exchange, test_options()).await;
    let two = InProcess::on(&db, &exchange, test_options()).await;
    // The partitions settle between the two first: a partition taken over is read from its start,
    // which would find the late rows without the positions' watch.
    wait_until(
        "the partitions split between the relays",
        Duration::from_secs(60),
        || async {
            let owners: Vec<i64> = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.relay_partitions WHERE owner IS NOT NULL GROUP BY owner",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
            (owners == vec![32, 32]).then_some(())
        },
    )
    .await;

    // An old snapshot, held throughout (a report, pg_dump).
    let report = db.held_snapshot().await;

    // The late producer: three rows of `late-1`, their seqs taken now, not committed.
    let mut late = db.pool.begin().await.unwrap();
    let mut late_rows: Vec<(i64, i16)> = Vec::new();
    for n in 1..=3 {
        let r: (i64, i16) = sqlx::query_as(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('acct', 'late-1', 'acct.late', $1) RETURNING seq, partition",
        )
        .bind(serde_json::json!({ "n": n }))
        .fetch_one(&mut *late)
        .await
        .unwrap();
        late_rows.push(r);
    }
    let (late_seq, late_partition) = late_rows[2];

    // Meanwhile 600 rows of other aggregates commit and are published, many in the late rows'
    // partition and with higher seqs: both relays pass the late rows' position.
    let mut above = 0;
    for batch in 0..6 {
        let mut tx = db.pool.begin().await.unwrap();
        for i in 0..100 {
            let (seq, partition): (i64, i16) = sqlx::query_as(
                "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('acct', $1, 'acct.other', '{}') RETURNING seq, partition",
            )
            .bind(format!("other-{}", batch * 100 + i))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
            above += i32::from(partition == late_partition && seq > late_seq);
        }
        tx.commit().await.unwrap();
    }
    // Received is not yet marked: a relay marks its rows published after the broker's confirm,
    // which can come after the queue delivered them. Wait for both.
    let mut got = Vec::new();
    wait_until("600 published and marked", Duration::from_secs(60), || {
        while let Ok(r) = rx.try_recv() {
            got.push(r);
        }
        let pool = db.pool.clone();
        let received = got.len();
        async move {
            let pending: i64 =
                sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE state = 'pending'")
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (received >= 600 && pending == 0).then_some(())
        }
    })
    .await;
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE state = 'pending'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        above > 0 && pending == 0,
        "{above} rows above the late rows' position in their partition were published first ({pending} pending)"
    );

    // Minutes later in a real system; seconds here, with the relays polling past the position.
    tokio::time::sleep(Duration::from_secs(3)).await;
    late.commit().await.unwrap();
    // And the aggregate goes on after it.
    for n in 4..=5 {
        sqlx::query(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('acct', 'late-1', 'acct.late', $1)",
        )
        .bind(serde_json::json!({ "n": n }))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    wait_until("the late rows published", Duration::from_secs(60), || {
        while let Ok(r) = rx.try_recv() {
            got.push(r);
        }
        let late = got.iter().filter(|r| r.routing_key == "acct.late").count();
        std::future::ready((late >= 5).then_some(()))
    })
    .await;
    report.rollback().await.unwrap();

    // Each once (no failure was injected), in the aggregate's order.
    let mut seen: HashMap<String, usize> = HashMap::new();
    let order: Vec<i64> = got
        .iter()
        .filter(|r| r.routing_key == "acct.late")
        .filter(|r| {
            let n = seen.entry(r.message_id.clone()).or_default();
            *n += 1;
            *n == 1
        })
        .map(|r| r.body["n"].as_i64().unwrap())
        .collect();
    assert_eq!(order, vec![1, 2, 3, 4, 5], "the aggregate's order");
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE state = 'pending'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(pending, 0, "nothing left behind");
    one.stop().await;
    two.stop().await;
}

/// The horizon the relay reports (`outbox_oldest_snapshot_age_seconds`, the dead tuples of the
/// product's tables): a report's snapshot held for a while shows, and its release too.
#[tokio::test]
async fn the_relay_reports_how_old_the_snapshot_holding_back_cleanup_is() {
    let db = TestDb::new().await;
    let schema = shared::schema::Schema::default();
    let report = db.held_snapshot().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = relay::store::horizon(&db.pool, &schema).await.unwrap();
    assert!(
        held.oldest_snapshot_age >= 2.0,
        "the report's snapshot: {held:?}"
    );
    assert!(
        held.dead_tuples.iter().any(|(t, _)| t == "messages"),
        "the outbox's tables are listed, partitions summed: {held:?}"
    );
    assert!(
        !held
            .dead_tuples
            .iter()
            .any(|(t, _)| t.starts_with("messages_")),
        "{held:?}"
    );
    report.rollback().await.unwrap();
    let released = relay::store::horizon(&db.pool, &schema).await.unwrap();
    assert!(
        released.oldest_snapshot_age < held.oldest_snapshot_age,
        "{released:?} after {held:?}"
    );
}
