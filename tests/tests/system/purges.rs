//! The purges of the product's hot tables under an old snapshot (issue 39, item 2).
//!
//! While a transaction holds a snapshot older than the rows a purge deletes, the index entries of
//! those rows stay (their tuples are not dead to everyone, so no scan may mark them). A purge that
//! starts every batch at the start of its index walks all of them again: its cost grows with the
//! square of what it deletes. Each test deletes 20,000 rows in batches of 500 under such a snapshot
//! and counts the index entries and heap tuples the purge read (`pg_stat_user_indexes`,
//! `pg_stat_user_tables`, flushed by the purge's own session): a few per row, not the ~430,000 a
//! purge that starts over in each batch reads.

use chrono::{Duration as ChronoDuration, Utc};
use shared::schema::Schema;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use std::time::Duration;
use system_tests::TestDb;
use tokio_util::sync::CancellationToken;

const ROWS: i64 = 20_000;
const BATCH: i64 = 500;

/// A pool of one session: the purge's reads are this session's statistics alone.
async fn one_session(db: &TestDb) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .expect("connect")
}

/// Index entries returned by scans of `table`'s indexes plus heap tuples its sequential scans read,
/// so far; flushes `session`'s statistics first.
async fn reads(db: &TestDb, session: &PgPool, table: &str) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(session)
        .await
        .unwrap();
    // The flush happens when the session goes idle, before it answers; one more statement is
    // certain to follow it.
    sqlx::query("SELECT 1").execute(session).await.unwrap();
    sqlx::query_scalar(
        "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE schemaname = 'outbox' AND relname = $1)::int8 \
              + (SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname = $1)",
    )
    .bind(table)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn count(db: &TestDb, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&db.pool).await.unwrap()
}

/// Asserts that deleting `ROWS` rows read a few entries each, not a number that grows with what
/// was deleted before: at most four per row (the entry the oldest-first scan returns, and where
/// the batch is probed by key, one per version of the row: an outbox row has two, pending and
/// published). A purge that starts over in each batch reads about 21 per row here.
fn assert_linear(what: &str, read: i64) {
    eprintln!("{what}: {read} entries and tuples read to delete {ROWS} rows under an old snapshot");
    assert!(
        read <= 4 * ROWS,
        "{what} read {read} entries to delete {ROWS} rows in batches of {BATCH} under an old snapshot: each batch walks the entries of the rows deleted before it"
    );
}

#[tokio::test]
async fn the_dedup_sweep_reads_each_old_row_about_once_under_an_old_snapshot() {
    let db = TestDb::new().await;
    let session = one_session(&db).await;
    // 20,000 rows two hours old (one millisecond apart), and 10 fresh ones that must stay.
    sqlx::query(
        "INSERT INTO outbox.processed_messages (consumer, message_id, processed_at) \
         SELECT 'plans', gen_random_uuid(), now() - interval '2 hours' + i * interval '1 ms' \
         FROM generate_series(1, $1) i",
    )
    .bind(ROWS)
    .execute(&session)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox.processed_messages (consumer, message_id) \
         SELECT 'plans', gen_random_uuid() FROM generate_series(1, 10)",
    )
    .execute(&session)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox.processed_messages")
        .execute(&session)
        .await
        .unwrap();
    let report = db.held_snapshot().await;
    let before = reads(&db, &session, "processed_messages").await;
    let swept = consumer::retention::sweep(
        &session,
        &Schema::default(),
        "plans",
        Duration::from_secs(3600),
        BATCH,
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    let read = reads(&db, &session, "processed_messages").await - before;
    report.rollback().await.unwrap();
    assert_eq!(swept, consumer::retention::Sweep::Deleted(ROWS as u64));
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox.processed_messages").await,
        10,
        "the rows younger than the retention stay"
    );
    assert_linear("dedup sweep", read);
}

#[tokio::test]
async fn the_webhook_inbox_purge_reads_each_old_row_about_once_under_an_old_snapshot() {
    let db = TestDb::new().await;
    let session = one_session(&db).await;
    sqlx::query(
        "INSERT INTO outbox.webhook_inbox (source, event_id, event_type, outcome, signed_at, received_at, payload) \
         SELECT 'plans', 'evt-' || i, 'charge.succeeded', 'applied', now(), now() - interval '10 days' + i * interval '1 ms', '{}' \
         FROM generate_series(1, $1) i",
    )
    .bind(ROWS)
    .execute(&session)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox.webhook_inbox (source, event_id, event_type, outcome, signed_at, payload) \
         SELECT 'plans', 'new-' || i, 'charge.succeeded', 'applied', now(), '{}' FROM generate_series(1, 10) i",
    )
    .execute(&session)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox.webhook_inbox")
        .execute(&session)
        .await
        .unwrap();
    let report = db.held_snapshot().await;
    let before = reads(&db, &session, "webhook_inbox").await;
    let purged = idempotency::webhooks::inbox::purge(
        &session,
        &Schema::default(),
        Utc::now() - ChronoDuration::days(3),
        BATCH,
    )
    .await
    .unwrap();
    let read = reads(&db, &session, "webhook_inbox").await - before;
    report.rollback().await.unwrap();
    assert_eq!(purged, ROWS as u64);
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox.webhook_inbox").await,
        10,
        "the events younger than the horizon stay"
    );
    assert_linear("webhook inbox purge", read);
}

#[tokio::test]
async fn the_idempotency_purge_reads_each_expired_record_about_once_under_an_old_snapshot() {
    let db = TestDb::new().await;
    let session = one_session(&db).await;
    // 10,000 completed records that expired, 10,000 reservations abandoned long ago, and a
    // completed record and a live reservation that must stay.
    sqlx::query(
        "INSERT INTO outbox.idempotency_keys (scope, operation, key_hash, fingerprint, status, response_status, response_body, lease_token, lease_expires_at, created_at, updated_at, expires_at) \
         SELECT 'plans', 'POST /x', sha256(i::text::bytea), sha256('f'::bytea), \
                CASE WHEN i % 2 = 0 THEN 'completed' ELSE 'processing' END, \
                CASE WHEN i % 2 = 0 THEN 200 END, CASE WHEN i % 2 = 0 THEN '{}' END, \
                CASE WHEN i % 2 = 1 THEN gen_random_uuid() END, \
                CASE WHEN i % 2 = 1 THEN now() - interval '3 days' + i * interval '1 ms' END, \
                now() - interval '4 days', now() - interval '4 days', \
                now() - interval '2 days' + i * interval '1 ms' \
         FROM generate_series(1, $1) i",
    )
    .bind(ROWS)
    .execute(&session)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox.idempotency_keys (scope, operation, key_hash, fingerprint, status, response_status, response_body, lease_token, lease_expires_at, created_at, updated_at, expires_at) VALUES \
         ('plans', 'POST /x', sha256('kept'::bytea), sha256('f'::bytea), 'completed', 200, '{}', NULL, NULL, now(), now(), now() + interval '1 day'), \
         ('plans', 'POST /x', sha256('live'::bytea), sha256('f'::bytea), 'processing', NULL, NULL, gen_random_uuid(), now() + interval '30 s', now(), now(), now() + interval '1 day')",
    )
    .execute(&session)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox.idempotency_keys")
        .execute(&session)
        .await
        .unwrap();
    let report = db.held_snapshot().await;
    let before = reads(&db, &session, "idempotency_keys").await;
    let purged = idempotency::purge_expired(
        &session,
        &Schema::default(),
        Utc::now(),
        Duration::from_secs(3600),
        BATCH as u32,
        1000,
    )
    .await
    .unwrap();
    let read = reads(&db, &session, "idempotency_keys").await - before;
    report.rollback().await.unwrap();
    assert_eq!(purged, ROWS as u64);
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox.idempotency_keys").await,
        2,
        "the record not yet expired and the live reservation stay"
    );
    assert_linear("idempotency purge", read);
}

#[tokio::test]
async fn the_retention_of_published_rows_reads_each_old_row_about_once_under_an_old_snapshot() {
    let db = TestDb::new().await;
    let session = one_session(&db).await;
    let rows: Vec<shared::NewMessage> = (0..ROWS)
        .map(|i| {
            shared::NewMessage::new(
                "acct",
                format!("a-{}", i % 1000),
                "acct.opened",
                serde_json::json!({ "i": i }),
            )
        })
        .collect();
    for chunk in rows.chunks(1000) {
        shared::outbox::enqueue_many(&session, chunk).await.unwrap();
    }
    // Published two days ago, one millisecond apart; 10 more published now, which stay.
    sqlx::query(
        "UPDATE outbox.messages SET state = 'published', \
             published_at = now() - interval '2 days' + seq * interval '1 ms'",
    )
    .execute(&session)
    .await
    .unwrap();
    let fresh: Vec<shared::NewMessage> = (0..10)
        .map(|i| {
            shared::NewMessage::new(
                "acct",
                "fresh",
                "acct.opened",
                serde_json::json!({ "i": i }),
            )
        })
        .collect();
    shared::outbox::enqueue_many(&session, &fresh)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE outbox.messages SET state = 'published', published_at = now() WHERE state = 'pending'",
    )
    .execute(&session)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox.messages")
        .execute(&session)
        .await
        .unwrap();
    let report = db.held_snapshot().await;
    let before = reads(&db, &session, "messages").await;
    // A pass as the retention loop runs it.
    let (mut purged, mut after) = (0, None);
    loop {
        let (n, last) = relay::store::purge_published(
            &session,
            &Schema::default(),
            Duration::from_secs(86_400),
            BATCH,
            after,
        )
        .await
        .unwrap();
        purged += n;
        after = last;
        if (n as i64) < BATCH {
            break;
        }
    }
    let read = reads(&db, &session, "messages").await - before;
    report.rollback().await.unwrap();
    assert_eq!(purged, ROWS as u64);
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox.messages").await,
        10,
        "the rows published within the retention stay"
    );
    assert_linear("retention of published rows", read);
}
