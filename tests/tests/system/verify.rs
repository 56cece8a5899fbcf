//! `relay verify` against a real database: missing ids, in-flight rows, the lag distribution,
//! escaped output, and the exit status.

use std::process::Command;
use system_tests::*;

async fn insert(
    pool: &sqlx::PgPool,
    aggregate_id: &str,
    event_type: &str,
    published: bool,
    age_secs: i64,
) -> uuid::Uuid {
    sqlx::query_scalar(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, state, published_at, created_at) \
         VALUES ('account', $1, $2, '{}', CASE WHEN $3 THEN 'published' ELSE 'pending' END, \
                 CASE WHEN $3 THEN now() - make_interval(secs => $4 - 1) END, now() - make_interval(secs => $4)) \
         RETURNING id",
    )
    .bind(aggregate_id)
    .bind(event_type)
    .bind(published)
    .bind(age_secs as f64)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn processed(pool: &sqlx::PgPool, consumer: &str, id: uuid::Uuid, lag_secs: f64) {
    sqlx::query(
        "INSERT INTO outbox.processed_messages (consumer, message_id, processed_at) \
         SELECT $1, id, created_at + make_interval(secs => $3) FROM outbox.messages WHERE id = $2",
    )
    .bind(consumer)
    .bind(id)
    .bind(lag_secs)
    .execute(pool)
    .await
    .unwrap();
}

fn verify(db_url: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(bin_path("relay"))
        .arg("verify")
        .args(args)
        .env("DATABASE_URL", db_url)
        .env("RUST_LOG", "error")
        .output()
        .expect("run relay verify");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// `relay verify` of `consumer`'s `payment.captured` events of the last hour, with `extra` flags.
fn verify_captured(db_url: &str, consumer: &str, extra: &[&str]) -> (Option<i32>, String) {
    let mut args = vec![
        "--consumer",
        consumer,
        "--since",
        "1h",
        "--event-type",
        "payment.captured",
    ];
    args.extend_from_slice(extra);
    verify(db_url, &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reports_missing_ids_lag_and_exit_status() {
    let db = TestDb::new().await;
    let consumer = "ledger";
    let mut done = Vec::new();
    for (i, lag) in [0.1, 0.2, 0.3, 0.4, 5.0].into_iter().enumerate() {
        let id = insert(&db.pool, &format!("a{i}"), "payment.captured", true, 60).await;
        processed(&db.pool, consumer, id, lag).await;
        done.push(id);
    }
    // Published, never processed, with a hostile aggregate id.
    let missing = insert(&db.pool, "evil\nFORGED LINE", "payment.captured", true, 60).await;
    // Not published yet; and another event type the consumer is not bound to.
    insert(&db.pool, "p", "payment.captured", false, 60).await;
    insert(&db.pool, "o", "order.placed", true, 60).await;
    // Published a moment ago: in flight with the default settle time.
    let fresh = insert(&db.pool, "fresh", "payment.captured", true, 1).await;

    let (code, json) = verify_captured(&db.url, consumer, &["--format", "json"]);
    assert_eq!(code, Some(2), "missing rows make the exit status 2: {json}");
    let r: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(r["published"], 7);
    assert_eq!(r["pending"], 1);
    assert_eq!(r["processed"], 5);
    assert_eq!(r["missing"], 1);
    assert_eq!(r["in_flight"], 1);
    assert_eq!(r["missing_ids"][0]["id"], missing.to_string());
    assert_eq!(r["duplicates_applied"], 0);
    let p50 = r["lag"]["p50_seconds"].as_f64().unwrap();
    let max = r["lag"]["max_seconds"].as_f64().unwrap();
    assert!((p50 - 0.3).abs() < 1e-6, "p50 {p50}");
    assert!((max - 5.0).abs() < 1e-6, "max {max}");

    let (code, human) = verify_captured(&db.url, consumer, &[]);
    assert_eq!(code, Some(2));
    assert!(human.contains(&missing.to_string()), "{human}");
    assert!(
        human.contains("evil\\nFORGED LINE"),
        "the id is escaped: {human}"
    );
    assert!(!human.lines().any(|l| l.starts_with("FORGED")), "{human}");
    assert!(human.contains("MISSING"), "{human}");

    let (_, prom) = verify_captured(&db.url, consumer, &["--format", "prometheus"]);
    assert!(
        prom.contains("outbox_verify_missing_messages{consumer=\"ledger\"} 1"),
        "{prom}"
    );

    // Once the consumer has them, nothing is missing: exit 0.
    processed(&db.pool, consumer, missing, 1.0).await;
    processed(&db.pool, consumer, fresh, 1.0).await;
    let (code, human) = verify_captured(&db.url, consumer, &["--settle", "0s"]);
    assert_eq!(code, Some(0), "{human}");
    assert!(human.contains("OK: nothing missing"), "{human}");
}
