//! CloudEvents binary mode, read back by a reader nobody here wrote: pika takes the deliveries off
//! the queue and the CloudEvents Python SDK's AMQP binding reads and validates each event
//! (tests/python/cloudevents_reader.py). Needs `python3` with `cloudevents==2.2.0` and `pika`
//! (`.ci/run` installs them); without them the test fails, it never skips.

use chrono::{DateTime, Utc};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use relay::cloudevents::Mode;
use serde_json::{Value, json};
use shared::NewMessage;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use system_tests::relays::{InProcess, test_options};
use system_tests::*;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Runs the Python reader on `queue` for `count` events: one JSON object per event.
fn read_with_the_sdk(queue: &str, count: usize) -> Vec<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/cloudevents_reader.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .args([&amqp_url(), queue, &count.to_string()])
        .output()
        .expect(
            "python3 runs (the CloudEvents SDK reader needs it; .ci/run installs its packages)",
        );
    assert!(
        out.status.success(),
        "the CloudEvents SDK reader failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("the reader prints JSON"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudevents_sdk_reads_every_attribute_and_the_data() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(true).await;
    let queue = broker.queue("ce");
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    declare_bound_queue(
        &conn,
        &exchange,
        &queue,
        &["#"],
        durable,
        FieldTable::default(),
    )
    .await;

    // Two events of one aggregate whose id needs percent-encoding (the first with trace context),
    // and one with an empty aggregate id (no partition key).
    let aggregate = "o 1/ä";
    let messages = [
        NewMessage::new(
            "order",
            aggregate,
            "order.placed",
            json!({"order": aggregate, "n": 1, "items": [1, 2]}),
        )
        .with_header("traceparent", TRACEPARENT)
        .with_header("tracestate", "rojo=00f067aa0ba902b7")
        .with_header("tenant", "t1"),
        NewMessage::new("order", aggregate, "order.paid", json!({"n": 2})),
        NewMessage::new("store", "", "store.opened", json!({"n": 3})),
    ];
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue_many(&mut *tx, &messages)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let options = relay::RelayOptions {
        cloudevents: Mode::Binary,
        cloudevents_source: "https://orders.example/outbox".into(),
        cloudevents_type_prefix: "com.example.".into(),
        ..test_options()
    };
    let relay = InProcess::on(&db, &exchange, options).await;
    wait_no_pending(&db.pool, Duration::from_secs(30)).await;
    relay.stop().await;
    assert_eq!(outbox_count(&db.pool, "dead").await, 0);

    let count = messages.len();
    let events = tokio::task::spawn_blocking({
        let queue = queue.clone();
        move || read_with_the_sdk(&queue, count)
    })
    .await
    .unwrap();
    assert_eq!(events.len(), 3);
    let by_id: BTreeMap<String, &Value> = events
        .iter()
        .map(|e| (e["message_id"].as_str().unwrap().to_owned(), e))
        .collect();

    let expected = [
        (
            &messages[0],
            "https://orders.example/outbox/order/o%201%2F%C3%A4",
            Some(aggregate),
            "00000000000000000001",
            true,
        ),
        (
            &messages[1],
            "https://orders.example/outbox/order/o%201%2F%C3%A4",
            Some(aggregate),
            "00000000000000000002",
            false,
        ),
        (
            &messages[2],
            "https://orders.example/outbox/store/",
            None,
            "00000000000000000001",
            false,
        ),
    ];
    for (m, source, partitionkey, sequence, traced) in expected {
        let e = by_id
            .get(&m.id.to_string())
            .unwrap_or_else(|| panic!("event {} not read: {events:?}", m.id));
        let a = &e["attributes"];
        assert_eq!(a["specversion"], "1.0", "{e}");
        assert_eq!(a["id"], m.id.to_string(), "{e}");
        assert_eq!(a["source"], source, "{e}");
        assert_eq!(a["type"], format!("com.example.{}", m.event_type), "{e}");
        assert_eq!(e["routing_key"], m.event_type.as_str());
        assert_eq!(a["datacontenttype"], "application/json", "{e}");
        assert_eq!(a["sequence"], sequence, "{e}");
        // The SDK parsed the time into a datetime: it is the row's created_at.
        let time: DateTime<Utc> = a["time"].as_str().unwrap().parse().unwrap();
        let created: DateTime<Utc> = e["created_at"].as_str().unwrap().parse().unwrap();
        assert_eq!(time, created, "{e}");
        assert!((Utc::now() - time).num_seconds().abs() < 120, "{e}");
        let mut names: BTreeSet<&str> = [
            "specversion",
            "id",
            "source",
            "type",
            "time",
            "datacontenttype",
            "sequence",
        ]
        .into();
        match partitionkey {
            Some(k) => {
                assert_eq!(a["partitionkey"], k, "{e}");
                names.insert("partitionkey");
            }
            None => assert!(a.get("partitionkey").is_none(), "{e}"),
        }
        if traced {
            assert_eq!(a["traceparent"], TRACEPARENT, "{e}");
            assert_eq!(a["tracestate"], "rojo=00f067aa0ba902b7", "{e}");
            names.extend(["traceparent", "tracestate"]);
        }
        let got: BTreeSet<&str> = a.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        assert_eq!(got, names, "exactly the mapped attributes: {e}");
        assert_eq!(e["data"], m.payload, "{e}");
    }
}

/// A row whose attribute would pass the AMQP 1.0 conversion limit goes dead with the reason; the
/// aggregate's next row is published as a CloudEvent all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_with_an_attribute_over_4096_bytes_goes_dead_with_the_reason() {
    let (db, exchange, mut rx, _keep) = relayed(true, &["#"]).await;

    let too_long = NewMessage::new("order", "o-1", "order.placed", json!({"n": 1}))
        .with_header("tracestate", "k=v,".repeat(1100));
    let next = NewMessage::new("order", "o-1", "order.paid", json!({"n": 2}));
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue_many(&mut *tx, &[too_long.clone(), next.clone()])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let options = relay::RelayOptions {
        cloudevents: Mode::Binary,
        ..test_options()
    };
    let relay = InProcess::on(&db, &exchange, options).await;
    let received = receive_n(&mut rx, 1, Duration::from_secs(30)).await;
    relay.stop().await;
    assert_eq!(received[0].message_id, next.id.to_string());
    assert_eq!(
        received[0].header("cloudEvents_sequence").as_deref(),
        Some("00000000000000000002")
    );
    let (state, reason): (String, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM outbox.messages WHERE id = $1")
            .bind(too_long.id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(state, "dead");
    let reason = reason.unwrap_or_default();
    assert!(
        reason.starts_with("unpublishable: ")
            && reason.contains("cloudEvents_tracestate")
            && reason.contains("4400 bytes")
            && reason.contains("4096"),
        "{reason}"
    );
}
