//! Trace context end to end: log lines about a message carry its trace_id and message_id, and
//! with OTLP export on, spans reach the collector under the message's trace.

use serde_json::{Value, json};
use shared::NewMessage;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use system_tests::signals::sigterm;
use system_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// JSON log lines of a child's stderr that mention `message_id` (in the event or its span).
fn lines_about(stderr: &str, message_id: &str) -> Vec<Value> {
    stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| field(v, "message_id").as_deref() == Some(message_id))
        .collect()
}

fn field(v: &Value, name: &str) -> Option<String> {
    v.get(name)
        .or_else(|| v.get("span").and_then(|s| s.get(name)))
        .and_then(|f| f.as_str().map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_log_lines_about_a_message_carry_its_trace_and_message_ids() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    // No alternate exchange: the unbound event is returned, and the relay logs the failure. (The
    // consumer asks for the alternate exchange too, then uses the exchange as it is: tracked.)
    let (conn, exchange) = broker.declared_outbox(false).await;
    let name = unique("traced").replace('_', "-");
    let topology = consumer::Topology::new(&name, &[Duration::from_millis(100)]);
    for q in topology.queues() {
        broker.track_queue(&q);
    }
    for e in topology.exchanges() {
        broker.track_exchange(&e);
    }

    // A malformed ledger event (the consumer dead-letters it and says why) and an unroutable one.
    let bad = NewMessage::new(
        "account",
        "a-1",
        "payment.captured",
        json!({"account": "a-1", "amount": "lots"}),
    )
    .with_header("traceparent", TRACEPARENT);
    let lost = NewMessage::new("account", "a-2", "nobody.listens", json!({}))
        .with_header("traceparent", TRACEPARENT);
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue_many(&mut *tx, &[bad.clone(), lost.clone()])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let consumer = Command::new(bin_path("producer"))
        .args([
            "ledger",
            "--name",
            &name,
            "--bind",
            "payment.captured",
            "--retry-delays",
            "100ms",
        ])
        .env("DATABASE_URL", &db.url)
        .env("AMQP_URL", amqp_url())
        .env("OUTBOX_EXCHANGE", &exchange)
        .env("METRICS_ADDR", free_addr().to_string())
        .env("LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // The relay starts once the consumer's queue is bound, so the ledger event is routable.
    let queue = topology.queue.clone();
    wait_until("the consumer is consuming", Duration::from_secs(30), || {
        let conn = &conn;
        let queue = queue.clone();
        async move {
            let q = plumbing::amqp::inspect_queue(conn, &queue).await.ok()?;
            (q.consumer_count() > 0).then_some(())
        }
    })
    .await;
    let relay = relays::relay_command(&db.url, &amqp_url(), &exchange, free_addr())
        .args(["--lease-ms", "2000", "--confirm-timeout-ms", "800"])
        .args(["--poll-interval-ms", "100"])
        .args(["--alternate-exchange", "false", "--max-attempts", "1"])
        .env("LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    // The consumer dead-letters the bad event; the relay gives up on the unroutable one.
    let dlq = topology.dead_letter_queue.clone();
    wait_until(
        "the bad event is dead-lettered",
        Duration::from_secs(30),
        || {
            let conn = &conn;
            let dlq = dlq.clone();
            async move {
                let q = plumbing::amqp::inspect_queue(conn, &dlq).await.ok()?;
                (q.message_count() == 1).then_some(())
            }
        },
    )
    .await;
    wait_until(
        "the unroutable row is dead",
        Duration::from_secs(30),
        || async { (outbox_count(&db.pool, "dead").await == 1).then_some(()) },
    )
    .await;

    sigterm(&relay);
    sigterm(&consumer);
    let relay_out = relay.wait_with_output().await.unwrap();
    let consumer_out = consumer.wait_with_output().await.unwrap();
    assert!(relay_out.status.success() && consumer_out.status.success());

    for (who, out, id) in [
        ("relay", &relay_out, lost.id),
        ("consumer", &consumer_out, bad.id),
    ] {
        let log = String::from_utf8_lossy(&out.stderr);
        let about = lines_about(&log, &id.to_string());
        assert!(
            !about.is_empty(),
            "no {who} log line about the message:\n{log}"
        );
        for l in &about {
            assert_eq!(
                field(l, "trace_id").as_deref(),
                Some(TRACE_ID),
                "{who}: {l}"
            );
        }
    }
}

/// Request line and body of each request a collector received.
type Requests = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A collector that records every request body sent to it.
async fn fake_collector() -> (std::net::SocketAddr, Requests) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let got: Requests = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let g = g.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                loop {
                    let Ok(n) = sock.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if buf.len() < end + 4 + len {
                        continue;
                    }
                    let body = buf[end + 4..end + 4 + len].to_vec();
                    let request_line = head.lines().next().unwrap_or("").to_string();
                    g.lock().unwrap().push((request_line, body));
                    buf.drain(..end + 4 + len);
                    let _ = sock
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n")
                        .await;
                }
            });
        }
    });
    (addr, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_otlp_on_the_relay_exports_its_publish_span_under_the_messages_trace() {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let exchange = broker.exchange("outbox");
    broker.track_exchange(&plumbing::amqp::unrouted_name(&exchange));
    broker.track_queue(&plumbing::amqp::unrouted_name(&exchange));
    let (collector, got) = fake_collector().await;

    let msg = NewMessage::new("order", "o-1", "order.placed", json!({}))
        .with_header("traceparent", TRACEPARENT);
    shared::outbox::enqueue(&db.pool, &msg).await.unwrap();
    let relay = relays::relay_command(&db.url, &amqp_url(), &exchange, free_addr())
        .args(["--lease-ms", "2000", "--confirm-timeout-ms", "800"])
        .args(["--poll-interval-ms", "100"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{collector}"))
        .env("RUST_LOG", "info")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_no_pending(&db.pool, Duration::from_secs(30)).await;
    sigterm(&relay); // shutdown flushes the exporter
    assert!(relay.wait_with_output().await.unwrap().status.success());

    let requests = got.lock().unwrap().clone();
    assert!(!requests.is_empty(), "nothing reached the collector");
    assert!(
        requests
            .iter()
            .all(|(line, _)| line.starts_with("POST /v1/traces")),
        "{requests:?}"
    );
    let trace_bytes: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&TRACE_ID[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let parent_bytes: Vec<u8> = (0..8)
        .map(|i| u8::from_str_radix(&"00f067aa0ba902b7"[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let exported = requests.iter().any(|(_, body)| {
        body.windows(16).any(|w| w == trace_bytes.as_slice())
            && body.windows(8).any(|w| w == parent_bytes.as_slice())
    });
    assert!(
        exported,
        "no exported span carries the message's trace id and parent span id"
    );
}
