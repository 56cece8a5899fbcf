//! The scenarios. Each stops by itself; sizes scale with `--scale`.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use anyhow::Context;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use shared::NewMessage;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Ceilings measured earlier in this run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Ceilings {
    pub amqp: Option<f64>,
    pub pg: Option<f64>,
    pub raw_consume: Option<f64>,
}

pub async fn run(name: &str, env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
    match name {
        "ceiling-amqp" => ceiling_amqp(env, c).await,
        "ceiling-pg" => ceiling_pg(env, c).await,
        "relay-drain" => relay_drain(env, c).await,
        "relay-skew" => crate::skew_scenario::relay_skew(env, c).await,
        "producer-insert" => crate::skew_scenario::producer_insert(env).await,
        "relay-latency" => relay_latency(env).await,
        "consumer" => consumer(env, c).await,
        "consumer-ordered" => crate::ordered_scenario::consumer_ordered(env).await,
        "consumer-ordered-scale" => crate::ordered_scenario::consumer_ordered_scale(env).await,
        "webhook-ingest" => crate::webhook_scenario::webhook_ingest(env).await,
        "processes-waiting" => crate::waiting_scenario::processes_waiting(env).await,
        "reconciliation" => crate::reconciliation_scenario::reconciliation(env).await,
        "end-to-end" => end_to_end(env).await,
        "api" => api(env).await,
        "soak-memory" => soak_memory(env).await,
        "table-growth" => table_growth(env).await,
        "processes" => crate::process_scenario::run(env).await,
        other => anyhow::bail!("unknown scenario {other}"),
    }
}

/// A ~208-byte JSON payload, like the reference figures.
pub fn payload(i: u64) -> serde_json::Value {
    serde_json::json!({
        "account": format!("acct-{:05}", i % 1000),
        "amount": (i % 997) as i64 + 1,
        "currency": "EUR",
        "reference": format!("bench-{i:012}"),
        "note": "a payload of about two hundred bytes, the size the reference figures used for every run"
    })
}

fn messages(from: u64, n: u64, aggregates: u64, event_type: &str) -> Vec<NewMessage> {
    (from..from + n)
        .map(|i| {
            NewMessage::new(
                "bench",
                format!("agg-{}", i % aggregates),
                event_type,
                payload(i),
            )
        })
        .collect()
}

/// The rows of step `i` of producer `p`: each producer writes its own 1,000 aggregates, as
/// services do when each business flow owns its aggregates (several producers hammering the same
/// aggregate in the same millisecond would measure the per-aggregate confirm chain instead).
fn producer_messages(p: u64, i: u64, rows: u64, event_type: &str) -> Vec<NewMessage> {
    (0..rows)
        .map(|k| {
            let n = p * 1_000_000_000 + i * 10 + k;
            NewMessage::new(
                "bench",
                format!("p{p}-agg-{}", (i * 10 + k) % 1000),
                event_type,
                payload(n),
            )
        })
        .collect()
}

/// Inserts `n` rows, 1000 per statement, in as few transactions as `per_tx` allows.
async fn fill_outbox(
    env: &BenchEnv,
    n: u64,
    aggregates: u64,
    event_type: &str,
) -> anyhow::Result<()> {
    let mut done = 0;
    while done < n {
        let mut tx = env.pool.begin().await?;
        let tx_end = (done + 100_000).min(n);
        while done < tx_end {
            let k = (tx_end - done).min(1000);
            shared::outbox::enqueue_many(&mut *tx, &messages(done, k, aggregates, event_type))
                .await?;
            done += k;
        }
        tx.commit().await?;
    }
    Ok(())
}

/// 1 while any row is pending, else 0: an index probe, so polling it does not load PostgreSQL.
pub(crate) async fn pending(env: &BenchEnv) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'pending' LIMIT 1) t",
    )
    .fetch_one(&env.pool)
    .await?)
}

/// Raw lapin: persistent publishes with confirms to a durable queue, windows of 256 and 1000.
async fn ceiling_amqp(env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
    let n = env.n(50_000, 500);
    let q = env.queue("ceiling", "ceiling.#").await?;
    let ch = env.conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = payload(1).to_string().into_bytes();
    let mut best = 0.0f64;
    let mut lines = Vec::new();
    // Bare messages (reference) and the relay's own message shape (properties and headers, sent
    // by the relay's publisher code, no database): the second is the ceiling the relay is held to.
    for shape in ["bare", "relay-shaped"] {
        for window in [256usize, 1000] {
            let mut publisher =
                relay::publisher::Publisher::new(&env.amqp_url, &env.exchange, true);
            publisher.ensure_connected().await?;
            let cpu = env::CpuSnapshot::take();
            let started = Instant::now();
            let mut in_flight = FuturesUnordered::new();
            let mut i = 0u64;
            while i < n {
                // Wait for room, then take every confirm that is already in: the broker confirms
                // in bulk, so the room comes in batches too.
                while in_flight.len() >= window {
                    let r: Result<Confirmation, lapin::Error> = in_flight.next().await.unwrap();
                    anyhow::ensure!(matches!(r?, Confirmation::Ack(None)), "publish not acked");
                    while let Some(Some(r)) = futures::FutureExt::now_or_never(in_flight.next()) {
                        anyhow::ensure!(matches!(r?, Confirmation::Ack(None)), "publish not acked");
                    }
                }
                // Hand lapin the whole batch at once, as the relay does: one write by its I/O
                // thread for all of them instead of a thread hand-off per publish.
                let room = ((window - in_flight.len()) as u64).min(n - i);
                let confirms = if shape == "bare" {
                    futures::future::join_all((i..i + room).map(|k| {
                        let props = BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_content_type("application/json".into())
                            .with_message_id(uuid::Uuid::now_v7().to_string().into());
                        ch.basic_publish(
                            env.exchange.as_str().into(),
                            format!("ceiling.{}", k % 10).into(),
                            BasicPublishOptions {
                                mandatory: true,
                                ..Default::default()
                            },
                            &body,
                            props,
                        )
                    }))
                    .await
                } else {
                    let rows: Vec<relay::store::OutboxRow> = (i..i + room)
                        .map(|k| relay::store::OutboxRow {
                            seq: k as i64,
                            id: uuid::Uuid::now_v7(),
                            aggregate_type: "bench".into(),
                            aggregate_id: format!("agg-{}", k % 1000),
                            aggregate_seq: (k / 1000 + 1) as i64,
                            event_type: format!("ceiling.{}", k % 10),
                            payload: payload(k).to_string(),
                            headers: Default::default(),
                            created_at: chrono::Utc::now(),
                            attempts: 0,
                            partition: 0,
                        })
                        .collect();
                    let limits = relay::encoder::Encoding {
                        frame_max: publisher.frame_max().unwrap_or(131_072),
                        max_payload_bytes: 16 * 1024 * 1024,
                        cloudevents: None,
                    };
                    let encoded = rows
                        .iter()
                        .map(|row| relay::encoder::encode(row, &limits))
                        .collect::<Result<Vec<_>, _>>()?;
                    futures::future::join_all(
                        rows.iter()
                            .zip(&encoded)
                            .map(|(row, e)| publisher.send(e, row.payload.as_bytes())),
                    )
                    .await
                };
                for c in confirms {
                    in_flight.push(c?);
                }
                i += room;
            }
            while let Some(r) = in_flight.next().await {
                anyhow::ensure!(matches!(r?, Confirmation::Ack(None)), "publish not acked");
            }
            let rate = n as f64 / started.elapsed().as_secs_f64();
            lines.push(
                Line::new(
                    &format!("ceiling-amqp ({shape}, window {window})"),
                    rate,
                    "msg/s",
                )
                .note(env::CpuSnapshot::take().report_since(&cpu, n)),
            );
            if shape == "relay-shaped" {
                best = best.max(rate);
            }
            publisher.disconnect().await;
            let purge = env.conn.create_channel().await?;
            purge
                .queue_purge(q.as_str().into(), Default::default())
                .await?;
        }
    }
    env.delete_queue(&q).await;
    c.amqp = Some(best);
    lines.push(Line::new("ceiling-amqp", best, "msg/s").note(format!(
        "{n} persistent publishes with confirms of the relay's message shape, best window"
    )));
    Ok(lines)
}

/// Raw claim-and-delete of outbox-shaped rows in batches of 1000, the statement shape the relay uses.
async fn ceiling_pg(env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
    let n = env.n(100_000, 1000);
    env.reset_outbox().await?;
    fill_outbox(env, n, 1000, "bench.ceiling").await?;
    sqlx::query("ANALYZE outbox.messages")
        .execute(&env.pool)
        .await?;
    let started = Instant::now();
    let mut done = 0u64;
    loop {
        let rows: Vec<(i64, uuid::Uuid, String)> = sqlx::query_as(
            "DELETE FROM outbox.messages WHERE seq IN ( \
                 SELECT seq FROM outbox.messages WHERE state = 'pending' ORDER BY seq LIMIT 1000 FOR UPDATE SKIP LOCKED) \
             RETURNING seq, id, payload::text",
        )
        .fetch_all(&env.pool)
        .await?;
        if rows.is_empty() {
            break;
        }
        done += rows.len() as u64;
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    c.pg = Some(rate);
    Ok(vec![Line::new("ceiling-pg", rate, "rows/s").note(format!(
        "{done} rows claimed and deleted, 1000 per statement"
    ))])
}

async fn wait_partitions_split(env: &BenchEnv, relays: i64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (owners, owned): (i64, i64) = sqlx::query_as(
            "SELECT count(DISTINCT owner), count(owner) FROM outbox.relay_partitions WHERE lease_until > now()",
        )
        .fetch_one(&env.pool)
        .await?;
        if owners == relays && owned == 64 {
            // Balanced: nobody holds more than its share.
            let max: i64 = sqlx::query_scalar(
                "SELECT coalesce(max(c), 0) FROM (SELECT count(*) c FROM outbox.relay_partitions GROUP BY owner) t",
            )
            .fetch_one(&env.pool)
            .await?;
            if max <= (64 + relays - 1) / relays {
                return Ok(());
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "relays did not share the partitions within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Drains a committed backlog with 1 and 2 relays, and with 1 relay in CloudEvents binary mode
/// (`--cloudevents binary`: seven more headers per message, these rows carry no trace context),
/// each against the same ceiling.
async fn relay_drain(env: &BenchEnv, c: &Ceilings) -> anyhow::Result<Vec<Line>> {
    let n = env.n(100_000, 1000);
    let ceiling = match (c.amqp, c.pg) {
        (Some(a), Some(p)) => Some(a.min(p)),
        _ => None,
    };
    let mut lines = Vec::new();
    for (relays, cloudevents) in [(1i64, false), (1, true), (2, false)] {
        env.reset_outbox().await?;
        let q = env.queue("drain", "bench.drain").await?;
        env.settle().await?;
        let flags: &[&str] = if cloudevents {
            &["--cloudevents", "binary"]
        } else {
            &[]
        };
        let children: Vec<_> = (0..relays)
            .map(|_| env.spawn_relay(flags))
            .collect::<Result<_, _>>()?;
        wait_partitions_split(env, relays).await?;
        // One transaction: the whole backlog becomes visible at once.
        let mut tx = env.pool.begin().await?;
        let mut done = 0;
        while done < n {
            let k = (n - done).min(1000);
            shared::outbox::enqueue_many(&mut *tx, &messages(done, k, 1000, "bench.drain")).await?;
            done += k;
        }
        tx.commit().await?;
        let cpu = env::CpuSnapshot::take();
        let started = Instant::now();
        let deadline = started + Duration::from_secs(300);
        while pending(env).await? > 0 {
            anyhow::ensure!(Instant::now() < deadline, "backlog not drained in 300 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        let cpu_note = env::CpuSnapshot::take().report_since(&cpu, n);
        for ch in children {
            env::stop(ch).await;
        }
        env.delete_queue(&q).await;
        let mut line = Line::new(
            &format!(
                "relay-drain ({relays} relay{}{})",
                if relays > 1 { "s" } else { "" },
                if cloudevents {
                    ", CloudEvents binary"
                } else {
                    ""
                }
            ),
            rate,
            "msg/s",
        );
        if let Some(ceil) = ceiling {
            line = line.vs_ceiling(ceil, Some(0.8));
        }
        lines.push(line.note(format!(
            "{n} committed rows, 1000 aggregates; ceiling = min(ceiling-amqp, ceiling-pg); {cpu_note}"
        )));
    }
    Ok(lines)
}

/// Commit-to-delivery latency at a fixed producer rate, measured from each transaction's commit.
async fn relay_latency(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let duration = env.secs(30.0, 2.0);
    env.reset_outbox().await?;
    let q = env.queue("latency", "bench.latency").await?;
    env.settle().await?;
    // The floor: the same rate published straight to the broker, publish -> delivery.
    let floor = measure_publish_to_delivery(
        env,
        &q,
        "bench.latency",
        duration.min(Duration::from_secs(10)),
        1000,
    )
    .await?;
    let relay = env.spawn_relay(&[])?;
    wait_partitions_split(env, 1).await?;
    let busy = env.settle().await?;
    let cpu = env::CpuSnapshot::take();
    let hist = measure_commit_to_delivery(env, &q, duration, 1000).await?;
    let cpu_note = env::CpuSnapshot::take().report_since(&cpu, hist.len());
    env::stop(relay).await;
    env.delete_queue(&q).await;
    let ms = |us: u64| us as f64 / 1000.0;
    let mut lines = latency_lines(
        "relay-latency",
        &hist,
        10.0,
        &format!(
            "commit -> delivery to a queue consumer, 1,000 msg/s, 1- and 10-row transactions on 4 connections; machine {:.0}% busy before the start, during: {cpu_note}",
            busy * 100.0
        ),
    );
    lines.push(Line::new(
        "relay-latency floor p50 (raw publish -> delivery)",
        ms(floor.value_at_quantile(0.5)),
        "ms",
    ));
    lines.push(
        Line::new("relay-latency floor p99 (raw publish -> delivery)", ms(floor.value_at_quantile(0.99)), "ms")
            .note("lapin publishing straight to the broker at the same rate, persistent, confirms on: the broker's own share"),
    );
    Ok(lines)
}

/// Publishes `rate` msg/s straight to the exchange (persistent, confirms drained in the
/// background) and measures publish -> delivery on `queue`, in microseconds.
async fn measure_publish_to_delivery(
    env: &BenchEnv,
    queue: &str,
    routing_key: &str,
    duration: Duration,
    rate: u64,
) -> anyhow::Result<Histogram<u64>> {
    let sent: Arc<Mutex<HashMap<String, Instant>>> = Arc::new(Mutex::new(HashMap::new()));
    let rx_ch = env.conn.create_channel().await?;
    rx_ch.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = rx_ch
        .basic_consume(
            queue.into(),
            "bench-floor".into(),
            // Manual acks, one per delivery, like a consumer (acks are quorum-queue log writes too).
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let expected = (rate as f64 * duration.as_secs_f64()) as u64;
    let s2 = sent.clone();
    let receiver = tokio::spawn(async move {
        let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
        let mut seen = 0u64;
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_secs(10), consumer.next()).await
        {
            let now = Instant::now();
            let _ = d.ack(lapin::options::BasicAckOptions::default()).await;
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_string())
                .unwrap_or_default();
            if let Some(t) = s2.lock().unwrap().remove(&id) {
                h.record(now.duration_since(t).as_micros().max(1) as u64)
                    .ok();
            }
            seen += 1;
            if seen >= expected {
                break;
            }
        }
        h
    });
    let ch = env.conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut confirms = FuturesUnordered::new();
    for i in 0..expected {
        tick.tick().await;
        let id = uuid::Uuid::now_v7().to_string();
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(id.clone().into());
        sent.lock().unwrap().insert(id, Instant::now());
        let body = payload(i).to_string();
        confirms.push(
            ch.basic_publish(
                env.exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?,
        );
        while let Some(Some(r)) = futures::FutureExt::now_or_never(confirms.next()) {
            r?;
        }
    }
    while let Some(r) = confirms.next().await {
        r?;
    }
    let h = receiver.await?;
    anyhow::ensure!(!h.is_empty(), "no deliveries measured");
    Ok(h)
}

fn latency_lines(name: &str, h: &Histogram<u64>, p99_target_ms: f64, note: &str) -> Vec<Line> {
    let ms = |us: u64| us as f64 / 1000.0;
    vec![
        Line::new(&format!("{name} p50"), ms(h.value_at_quantile(0.5)), "ms"),
        Line::new(&format!("{name} p99"), ms(h.value_at_quantile(0.99)), "ms")
            .at_most(p99_target_ms)
            .note(format!("{note}; {} samples", h.len())),
        Line::new(&format!("{name} max"), ms(h.max()), "ms"),
    ]
}

/// Producers commit `rate` msg/s for `duration` (half in single-row, half in 10-row transactions,
/// 4 connections); a consumer on `queue` records delivery times. Returns latencies in microseconds.
async fn measure_commit_to_delivery(
    env: &BenchEnv,
    queue: &str,
    duration: Duration,
    rate: u64,
) -> anyhow::Result<Histogram<u64>> {
    let commits: Arc<Mutex<HashMap<String, Instant>>> = Arc::new(Mutex::new(HashMap::new()));
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let ch = env.conn.create_channel().await?;
    ch.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "bench-latency".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let (c2, h2) = (commits.clone(), hist.clone());
    let expected = rate * duration.as_secs_f64() as u64;
    let receiver = tokio::spawn(async move {
        let mut early: HashMap<String, Instant> = HashMap::new();
        let mut seen = 0u64;
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_secs(10), consumer.next()).await
        {
            let now = Instant::now();
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_string())
                .unwrap_or_default();
            let committed = c2.lock().unwrap().remove(&id);
            match committed {
                Some(t) => {
                    h2.lock()
                        .unwrap()
                        .record(now.duration_since(t).as_micros().max(1) as u64)
                        .ok();
                }
                None => {
                    early.insert(id, now);
                }
            }
            seen += 1;
            if seen >= expected {
                break;
            }
        }
        early
    });

    let c = commits.clone();
    let record: OnCommit = Arc::new(move |msgs: &[NewMessage]| {
        let now = Instant::now();
        let mut c = c.lock().unwrap();
        for m in msgs {
            c.insert(m.id.to_string(), now);
        }
    });
    for p in spawn_commit_load(env, duration, rate, "bench.latency", Some(record)) {
        p.await??;
    }
    let early = receiver.await?;
    // Deliveries that arrived before the producer recorded its commit time: latency ~0.
    let mut h = hist.lock().unwrap().clone();
    let c = commits.lock().unwrap();
    for (id, _) in early {
        if !c.contains_key(&id) {
            h.record(1).ok();
        }
    }
    anyhow::ensure!(!h.is_empty(), "no deliveries measured");
    Ok(h)
}

/// Publishes `n` ledger events (`payment.captured`) to the exchange with confirms.
async fn publish_ledger_events(env: &BenchEnv, n: u64, routing_key: &str) -> anyhow::Result<()> {
    let ch = env.conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut in_flight = FuturesUnordered::new();
    for i in 0..n {
        while in_flight.len() >= 1000 {
            let r: Result<Confirmation, lapin::Error> = in_flight.next().await.unwrap();
            anyhow::ensure!(matches!(r?, Confirmation::Ack(None)), "publish not acked");
        }
        let body = payload(i).to_string();
        let mut headers = FieldTable::default();
        headers.insert(
            "aggregate_type".into(),
            lapin::types::AMQPValue::LongString("account".into()),
        );
        headers.insert(
            "aggregate_id".into(),
            lapin::types::AMQPValue::LongString(format!("acct-{:05}", i % 1000).into()),
        );
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_type("payment.captured".into())
            .with_message_id(uuid::Uuid::now_v7().to_string().into())
            .with_headers(headers);
        let confirm = ch
            .basic_publish(
                env.exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                props,
            )
            .await?;
        in_flight.push(confirm);
    }
    while let Some(r) = in_flight.next().await {
        anyhow::ensure!(matches!(r?, Confirmation::Ack(None)), "publish not acked");
    }
    Ok(())
}

fn consumer_topology(name: &str) -> consumer::Topology {
    let delays: Vec<Duration> = ["1s", "10s", "1m", "5m"]
        .iter()
        .map(|d| consumer::config::parse_duration(d).expect("valid default delay"))
        .collect();
    consumer::Topology::new(name, &delays)
}

pub(crate) async fn delete_consumer_topology(env: &BenchEnv, name: &str) {
    let t = consumer_topology(name);
    for q in t.queues() {
        env.delete_queue(&q).await;
    }
    if let Ok(ch) = env.conn.create_channel().await {
        for e in t.exchanges() {
            let _ = ch
                .exchange_delete(e.as_str().into(), Default::default())
                .await;
        }
    }
}

async fn ledger_updates(env: &BenchEnv) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT coalesce(sum(updates), 0)::bigint FROM demo.ledger_balances")
            .fetch_one(&env.pool)
            .await?,
    )
}

/// Raw consume+ack from a quorum queue vs the ledger consumer (dedup + effect) on the same messages.
async fn consumer(env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
    let n = env.n(50_000, 500);
    // Raw: a quorum queue like the consumer's, manual ack per message, prefetch 1000.
    let raw_q = env.quorum_queue("raw", "raw.captured").await?;
    publish_ledger_events(env, n, "raw.captured").await?;
    let ch = env.conn.create_channel().await?;
    ch.basic_qos(1000, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            raw_q.as_str().into(),
            "bench-raw".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let started = Instant::now();
    let mut got = 0u64;
    while got < n {
        let d = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .context("raw consume stalled")?
            .context("consumer ended")??;
        d.ack(lapin::options::BasicAckOptions::default()).await?;
        got += 1;
    }
    let raw = n as f64 / started.elapsed().as_secs_f64();
    drop(consumer);
    let _ = ch.close(200, "done".into()).await;
    env.delete_queue(&raw_q).await;
    c.raw_consume = Some(raw);

    // The ledger consumer: start once to declare its queue, stop, fill the queue, start and time it.
    let name = format!("{}-ledger", env.exchange.replace('.', "-"));
    let args = [
        "ledger",
        "--name",
        name.as_str(),
        "--bind",
        "payment.captured",
    ];
    let first = env.spawn("producer", &args, &[])?;
    wait_queue_exists(env, &name).await?;
    env::stop(first).await;
    sqlx::query("TRUNCATE demo.ledger_balances, outbox.processed_messages")
        .execute(&env.pool)
        .await?;
    publish_ledger_events(env, n, "payment.captured").await?;
    let consumer = env.spawn("producer", &args, &[])?;
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut t0 = None;
    loop {
        let done = ledger_updates(env).await?;
        if done > 0 && t0.is_none() {
            t0 = Some((Instant::now(), done));
        }
        if done as u64 >= n {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "consumer did not finish in 300 s ({done} of {n})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (t0, first_done) = t0.context("no progress")?;
    let rate = (n - first_done as u64) as f64 / t0.elapsed().as_secs_f64().max(1e-6);
    env::stop(consumer).await;
    delete_consumer_topology(env, &name).await;
    Ok(vec![
        Line::new("consumer raw consume+ack", raw, "msg/s").note(format!("{n} messages from a quorum queue, manual ack, prefetch 1000")),
        Line::new("consumer ledger (dedup + effect)", rate, "msg/s")
            .vs_ceiling(raw, Some(0.6))
            .note("consumer binary with default settings; ceiling = raw consume+ack of the same messages"),
    ])
}

pub(crate) async fn wait_queue_exists(env: &BenchEnv, queue: &str) -> anyhow::Result<()> {
    wait_queue_consumed(&env.conn, queue).await
}

/// Waits until `queue` exists on the broker of `conn` with a consumer attached.
pub(crate) async fn wait_queue_consumed(
    conn: &lapin::Connection,
    queue: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // Consumers attached means the consumer is fully up.
        if let Ok(q) = plumbing::amqp::inspect_queue(conn, queue).await
            && q.consumer_count() > 0
        {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "consumer queue {queue} not declared within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Called after each producer commit with the committed messages.
type OnCommit = Arc<dyn Fn(&[NewMessage]) + Send + Sync>;

/// Producers committing outbox rows of `event_type` at `rate` msg/s for `duration`: 4
/// connections, half the rows in single-row and half in 10-row transactions; `on_commit` sees
/// each transaction's messages right after its commit returned.
fn spawn_commit_load(
    env: &BenchEnv,
    duration: Duration,
    rate: u64,
    event_type: &'static str,
    on_commit: Option<OnCommit>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    (0..4u64)
        .map(|p| {
            let pool = env.pool.clone();
            let on_commit = on_commit.clone();
            tokio::spawn(async move {
                // Cycles of 11 transactions: one 10-row transaction, then ten single-row ones,
                // so half the rows go in each kind, evenly spread over time (not bunched at the
                // start of each second); each connection starts at its own phase of the cycle.
                let cycles_per_sec = (rate as f64 / 4.0 / 20.0).max(0.05);
                let mut tick =
                    tokio::time::interval(Duration::from_secs_f64(1.0 / (cycles_per_sec * 11.0)));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let end = Instant::now() + duration;
                let mut i = 0u64;
                while Instant::now() < end {
                    tick.tick().await;
                    let rows = if (i + p * 3).is_multiple_of(11) {
                        10
                    } else {
                        1
                    };
                    let msgs = producer_messages(p, i, rows, event_type);
                    let mut tx = pool.begin().await?;
                    shared::outbox::enqueue_many(&mut *tx, &msgs).await?;
                    tx.commit().await?;
                    if let Some(f) = &on_commit {
                        f(&msgs);
                    }
                    i += 1;
                }
                Ok(())
            })
        })
        .collect()
}

/// Producer commit to consumer commit at 1,000 msg/s: relay + ledger consumer running.
async fn end_to_end(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let duration = env.secs(30.0, 2.0);
    env.reset_outbox().await?;
    sqlx::query("TRUNCATE demo.ledger_balances, outbox.processed_messages")
        .execute(&env.pool)
        .await?;
    let name = format!("{}-e2e", env.exchange.replace('.', "-"));
    let consumer = env.spawn(
        "producer",
        &[
            "ledger",
            "--name",
            name.as_str(),
            "--bind",
            "payment.captured",
        ],
        &[],
    )?;
    wait_queue_exists(env, &name).await?;
    let relay = env.spawn_relay(&[])?;
    wait_partitions_split(env, 1).await?;
    let busy = env.settle().await?;

    // Producers: like relay-latency, but ledger events, recording each commit's wall-clock time.
    let commits: Arc<Mutex<HashMap<uuid::Uuid, chrono::DateTime<chrono::Utc>>>> =
        Arc::new(Mutex::new(HashMap::new()));
    let c = commits.clone();
    let record: OnCommit = Arc::new(move |msgs: &[NewMessage]| {
        let now = chrono::Utc::now();
        let mut c = c.lock().unwrap();
        for m in msgs {
            c.insert(m.id, now);
        }
    });
    let cpu = env::CpuSnapshot::take();
    for p in spawn_commit_load(env, duration, 1000, "payment.captured", Some(record)) {
        p.await??;
    }
    let total = commits.lock().unwrap().len() as i64;
    let cpu_note = env::CpuSnapshot::take().report_since(&cpu, total as u64);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.processed_messages WHERE consumer = $1",
        )
        .bind(&name)
        .fetch_one(&env.pool)
        .await?;
        if done >= total {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {done} of {total} processed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rows: Vec<(uuid::Uuid, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT message_id, processed_at FROM outbox.processed_messages WHERE consumer = $1",
    )
    .bind(&name)
    .fetch_all(&env.pool)
    .await?;
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    {
        let commits = commits.lock().unwrap();
        for (id, at) in rows {
            if let Some(c) = commits.get(&id) {
                h.record((at - *c).num_microseconds().unwrap_or(0).max(1) as u64)
                    .ok();
            }
        }
    }
    env::stop(relay).await;
    env::stop(consumer).await;
    delete_consumer_topology(env, &name).await;
    anyhow::ensure!(!h.is_empty(), "no latencies measured");
    // The floor: the same rate published straight into a quorum queue (the consumer's queue
    // type), publish -> delivery, no database on either side.
    let floor_q = env.quorum_queue("e2e-floor", "floor.quorum").await?;
    let floor_time = duration.min(Duration::from_secs(10));
    let floor =
        measure_publish_to_delivery(env, &floor_q, "floor.quorum", floor_time, 1000).await?;
    // The same, while PostgreSQL commits 1,000 rows/s as in the run (both services fsync to one
    // disk): how much of the end-to-end latency the services' own contention explains.
    let load = spawn_commit_load(env, floor_time, 1000, "bench.load", None);
    let floor_loaded =
        measure_publish_to_delivery(env, &floor_q, "floor.quorum", floor_time, 1000).await?;
    for l in load {
        l.await??;
    }
    env.reset_outbox().await?;
    env.delete_queue(&floor_q).await;
    let ms = |us: u64| us as f64 / 1000.0;
    let mut lines = latency_lines(
        "end-to-end",
        &h,
        25.0,
        &format!(
            "producer commit -> consumer transaction (processed_at), 1,000 msg/s, relay + ledger consumer; machine {:.0}% busy before the start, during: {cpu_note}",
            busy * 100.0
        ),
    );
    lines.push(Line::new(
        "end-to-end floor p50 (raw publish -> quorum queue delivery)",
        ms(floor.value_at_quantile(0.5)),
        "ms",
    ));
    lines.push(Line::new(
        "end-to-end floor p99 (raw publish -> quorum queue delivery)",
        ms(floor.value_at_quantile(0.99)),
        "ms",
    ));
    lines.push(Line::new(
        "end-to-end floor p50 (same, with 1,000 commits/s in PostgreSQL)",
        ms(floor_loaded.value_at_quantile(0.5)),
        "ms",
    ));
    lines.push(
        Line::new("end-to-end floor p99 (same, with 1,000 commits/s in PostgreSQL)", ms(floor_loaded.value_at_quantile(0.99)), "ms")
            .note("quorum queues deliver after their Raft log is fsynced; PostgreSQL fsyncs its WAL on the same disk"),
    );
    Ok(lines)
}

/// POST /orders through the real producer binary at fixed concurrency: new keys, then replays.
async fn api(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let duration = env.secs(10.0, 1.0);
    let concurrency = 16usize;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let key_out = tokio::process::Command::new(env.bin("producer")?)
        .args(["api-key", "create", "--tenant", "bench"])
        .env("DATABASE_URL", &env.db_url)
        .env("RUST_LOG", "warn")
        .output()
        .await?;
    anyhow::ensure!(key_out.status.success(), "api-key create failed");
    let api_key = String::from_utf8(key_out.stdout)?.trim().to_string();
    let producer = env.spawn("producer", &[], &[("LISTEN_ADDR", &addr.to_string())])?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let base = format!("http://{addr}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .map(|r| r.status().is_success())
        .ok()
        != Some(true)
    {
        anyhow::ensure!(Instant::now() < deadline, "producer not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let body = serde_json::json!({"customer_id": "c-1", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]});
    let mut lines = Vec::new();
    let keys: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    for mode in ["new keys", "replays"] {
        let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
            1, 60_000_000, 3,
        )?));
        let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let started = Instant::now();
        let end = started + duration;
        let mut workers = Vec::new();
        for w in 0..concurrency {
            let (http, base, api_key, body, hist, count, keys) = (
                http.clone(),
                base.clone(),
                api_key.clone(),
                body.clone(),
                hist.clone(),
                count.clone(),
                keys.clone(),
            );
            let replay = mode == "replays";
            workers.push(tokio::spawn(async move {
                let mut i = 0usize;
                while Instant::now() < end {
                    let key = if replay {
                        let k = keys.lock().unwrap();
                        anyhow::ensure!(!k.is_empty(), "no keys to replay");
                        k[(w * 7919 + i) % k.len()].clone()
                    } else {
                        uuid::Uuid::new_v4().to_string()
                    };
                    let t = Instant::now();
                    let r = http
                        .post(format!("{base}/orders"))
                        .bearer_auth(&api_key)
                        .header("Idempotency-Key", &key)
                        .json(&body)
                        .send()
                        .await?;
                    let status = r.status();
                    let _ = r.bytes().await?;
                    anyhow::ensure!(status.as_u16() == 201, "unexpected status {status}");
                    hist.lock()
                        .unwrap()
                        .record(t.elapsed().as_micros().max(1) as u64)
                        .ok();
                    count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if !replay {
                        keys.lock().unwrap().push(key);
                    }
                    i += 1;
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for w in workers {
            w.await??;
        }
        let n = count.load(std::sync::atomic::Ordering::Relaxed);
        let rate = n as f64 / started.elapsed().as_secs_f64();
        let h = hist.lock().unwrap().clone();
        lines.push(
            Line::new(&format!("api POST /orders {mode}"), rate, "req/s")
                .note(format!("{concurrency} concurrent clients, {n} requests")),
        );
        lines.push(Line::new(
            &format!("api POST /orders {mode} p99"),
            h.value_at_quantile(0.99) as f64 / 1000.0,
            "ms",
        ));
    }
    env::stop(producer).await;
    Ok(lines)
}

/// Peak RSS of one relay process draining a large backlog.
async fn soak_memory(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(1_000_000, 2000);
    env.reset_outbox().await?;
    let q = env.queue("soak", "bench.soak").await?;
    fill_outbox(env, n, 10_000, "bench.soak").await?;
    let relay = env.spawn_relay(&[])?;
    let pid = relay.id().context("relay pid")?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    let mut peak = 0u64;
    while pending(env).await? > 0 {
        if let Some((hwm, _)) = env::rss(pid) {
            peak = peak.max(hwm);
        }
        anyhow::ensure!(Instant::now() < deadline, "soak not drained in 600 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Some((hwm, _)) = env::rss(pid) {
        peak = peak.max(hwm);
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    env::stop(relay).await;
    env.delete_queue(&q).await;
    let mib = peak as f64 / (1024.0 * 1024.0);
    Ok(vec![
        Line::new("soak-memory (relay peak RSS)", mib, "MiB")
            .at_most(64.0)
            .note(format!(
                "{n} rows drained at {rate:.0} msg/s, VmHWM of the relay process"
            )),
    ])
}

/// The relay's own claim query, with and without a large table of retained and dead rows.
async fn table_growth(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let filler = env.n(10_000_000, 10_000);
    let n = env.n(200_000, 1000);
    // Each rate is the median of three runs: one run is short and moves with autovacuum. The
    // empty table is measured before and after the full one, and the full table is compared with
    // their mean, so a drift of the machine during the scenario does not count as table growth.
    let empty_before = median_claim_rate(env, n).await?;
    // Half published-and-retained, half dead, spread over all partitions; in chunks, on one
    // connection without the statement timeout the services use.
    let mut conn = env.pool.acquire().await?;
    sqlx::query("SET statement_timeout = 0")
        .execute(&mut *conn)
        .await?;
    let chunk = 1_000_000u64;
    let mut done = 0u64;
    while done < filler {
        let k = chunk.min(filler - done);
        sqlx::query(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, state, published_at, attempts, last_error) \
             SELECT 'bench', 'agg-' || (g % 100000), 'bench.old', '{\"old\": true}'::jsonb, \
                    CASE WHEN g % 2 = 0 THEN 'published' ELSE 'dead' END, \
                    CASE WHEN g % 2 = 0 THEN now() ELSE NULL END, \
                    CASE WHEN g % 2 = 0 THEN 0 ELSE 10 END, \
                    CASE WHEN g % 2 = 0 THEN NULL ELSE 'nacked by broker' END \
             FROM generate_series($1, $2) g",
        )
        .bind((done + 1) as i64)
        .bind((done + k) as i64)
        .execute(&mut *conn)
        .await?;
        done += k;
    }
    sqlx::query("VACUUM ANALYZE outbox.messages")
        .execute(&mut *conn)
        .await?;
    sqlx::query("RESET statement_timeout")
        .execute(&mut *conn)
        .await?;
    drop(conn);
    let full = median_claim_rate(env, n).await?;
    sqlx::query("TRUNCATE outbox.messages")
        .execute(&env.pool)
        .await?;
    let empty_after = median_claim_rate(env, n).await?;
    let empty = (empty_before + empty_after) / 2.0;
    let ratio = full / empty;
    let mut line = Line::new(
        &format!("table-growth (claim rate with {filler} retained/dead rows)"),
        full,
        "rows/s",
    )
    .vs_ceiling(empty, Some(0.9));
    line.target = Some("within 10% of empty table".into());
    line.met = Some(ratio >= 0.9);
    Ok(vec![
        Line::new("table-growth (claim rate, empty table)", empty, "rows/s").note(format!(
            "mean of the empty table before ({empty_before:.0} rows/s) and after ({empty_after:.0} rows/s) the full one"
        )),
        line.note(format!("relay::store::claim + delete of {n} rows, batch 1000, all 64 partitions owned; median of 3 runs each, each after VACUUM and CHECKPOINT")),
    ])
}

async fn median_claim_rate(env: &BenchEnv, n: u64) -> anyhow::Result<f64> {
    let mut rates = Vec::new();
    for _ in 0..3 {
        rates.push(claim_rate(env, n).await?);
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[1])
}

async fn claim_rate(env: &BenchEnv, n: u64) -> anyhow::Result<f64> {
    sqlx::query("DELETE FROM outbox.messages WHERE state = 'pending'")
        .execute(&env.pool)
        .await?;
    sqlx::query("UPDATE outbox.relay_partitions SET owner = 'bench', lease_until = 'infinity', blocked_until = NULL, blocked_seq = NULL")
        .execute(&env.pool)
        .await?;
    fill_outbox(env, n, 1000, "bench.claim").await?;
    // Same table state for both measurements: vacuumed and analyzed right before.
    env.without_timeout(&["VACUUM ANALYZE outbox.messages"])
        .await?;
    env.settle().await?;
    let partitions: Vec<i16> = (0..64).collect();
    let per_partition = vec![32i64; partitions.len()];
    let schema = shared::schema::Schema::default();
    let started = Instant::now();
    let mut done = 0u64;
    loop {
        let args = relay::store::ClaimArgs {
            partitions: &partitions,
            per_partition: &per_partition,
            limit: 1000,
            held: &[],
        };
        let rows = relay::store::claim(&env.pool, &schema, "bench", &args).await?;
        let seqs: Vec<i64> = rows
            .iter()
            .map(|c| match c {
                relay::store::Claimed::Row(r) => r.seq,
                relay::store::Claimed::Undecodable { seq, .. } => *seq,
            })
            .collect();
        if seqs.is_empty() {
            break;
        }
        relay::store::mark_published(&env.pool, &schema, &seqs, false).await?;
        done += seqs.len() as u64;
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    sqlx::query("UPDATE outbox.relay_partitions SET owner = NULL, lease_until = '-infinity'")
        .execute(&env.pool)
        .await?;
    Ok(rate)
}
