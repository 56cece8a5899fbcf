//! Latency at a steady 1,000 msg/s: commit to delivery (relay-latency) and commit to the consumer's transaction (end-to-end), each with the broker's own floor.

use crate::consumer_scenario::{delete_consumer_topology, wait_queue_exists};
use crate::env::{self, BenchEnv};
use crate::relay_scenario::wait_partitions_split;
use crate::report::Line;
use crate::scenarios::*;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use shared::NewMessage;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Called after each producer commit with the committed messages.
type OnCommit = Arc<dyn Fn(&[NewMessage]) + Send + Sync>;

/// Commit-to-delivery latency at a fixed producer rate, measured from each transaction's commit.
pub(crate) async fn relay_latency(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
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
    let mut lines = latency_lines(
        "relay-latency",
        &hist,
        10.0,
        &format!(
            "commit -> delivery to a queue consumer, 1,000 msg/s, 1- and 10-row transactions on 4 connections; machine {:.0}% busy before the start, during: {cpu_note}",
            busy * 100.0
        ),
    );
    lines.extend(floor_lines(
        "relay-latency",
        "raw publish -> delivery",
        &floor,
        Some("lapin publishing straight to the broker at the same rate, persistent, confirms on: the broker's own share"),
    ));
    Ok(lines)
}

/// Publishes `rate` msg/s straight to the exchange (persistent, confirms drained in the
/// background) and measures publish -> delivery on `queue`, in microseconds.
pub(crate) async fn measure_publish_to_delivery(
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
        while let Some((d, now, id)) = next_delivery(&mut consumer).await {
            let _ = d.ack(lapin::options::BasicAckOptions::default()).await;
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

/// The next delivery with its arrival time and message id; `None` after 10 s without one.
async fn next_delivery(consumer: &mut lapin::Consumer) -> Option<(Delivery, Instant, String)> {
    let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_secs(10), consumer.next()).await
    else {
        return None;
    };
    let now = Instant::now();
    let id = d
        .properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str().to_string())
        .unwrap_or_default();
    Some((d, now, id))
}

/// The p50 and p99 lines of a floor (`{name} floor p50 ({what})`), the p99 with `note` if any.
fn floor_lines(name: &str, what: &str, floor: &Histogram<u64>, note: Option<&str>) -> [Line; 2] {
    let ms = |q: f64| floor.value_at_quantile(q) as f64 / 1000.0;
    let p99 = Line::new(&format!("{name} floor p99 ({what})"), ms(0.99), "ms");
    [
        Line::new(&format!("{name} floor p50 ({what})"), ms(0.5), "ms"),
        match note {
            Some(note) => p99.note(note),
            None => p99,
        },
    ]
}

pub(crate) fn latency_lines(
    name: &str,
    h: &Histogram<u64>,
    p99_target_ms: f64,
    note: &str,
) -> Vec<Line> {
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
pub(crate) async fn measure_commit_to_delivery(
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
        while let Some((_, now, id)) = next_delivery(&mut consumer).await {
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

/// Producers committing outbox rows of `event_type` at `rate` msg/s for `duration`: 4
/// connections, half the rows in single-row and half in 10-row transactions; `on_commit` sees
/// each transaction's messages right after its commit returned.
pub(crate) fn spawn_commit_load(
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
pub(crate) async fn end_to_end(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
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
    let (h, cpu_note) = commit_to_effect(env, &name, duration).await?;
    env::stop(relay).await;
    env::stop(consumer).await;
    delete_consumer_topology(env, &name).await;
    anyhow::ensure!(!h.is_empty(), "no latencies measured");
    let (floor, floor_loaded) = quorum_floors(env, duration).await?;
    let mut lines = latency_lines(
        "end-to-end",
        &h,
        25.0,
        &format!(
            "producer commit -> consumer transaction (processed_at), 1,000 msg/s, relay + ledger consumer; machine {:.0}% busy before the start, during: {cpu_note}",
            busy * 100.0
        ),
    );
    lines.extend(floor_lines(
        "end-to-end",
        "raw publish -> quorum queue delivery",
        &floor,
        None,
    ));
    lines.extend(floor_lines(
        "end-to-end",
        "same, with 1,000 commits/s in PostgreSQL",
        &floor_loaded,
        Some("quorum queues deliver after their Raft log is fsynced; PostgreSQL fsyncs its WAL on the same disk"),
    ));
    Ok(lines)
}

/// Producers like relay-latency's, but ledger events, recording each commit's wall-clock time;
/// then waits until consumer `name` processed them all and returns each message's commit to its
/// `processed_at` (microseconds) with the CPU note of the load.
async fn commit_to_effect(
    env: &BenchEnv,
    name: &str,
    duration: Duration,
) -> anyhow::Result<(Histogram<u64>, String)> {
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
        .bind(name)
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
    .bind(name)
    .fetch_all(&env.pool)
    .await?;
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let commits = commits.lock().unwrap();
    for (id, at) in rows {
        if let Some(c) = commits.get(&id) {
            h.record((at - *c).num_microseconds().unwrap_or(0).max(1) as u64)
                .ok();
        }
    }
    Ok((h, cpu_note))
}

/// The floor: the same rate published straight into a quorum queue (the consumer's queue type),
/// publish -> delivery, no database on either side; then the same while PostgreSQL commits 1,000
/// rows/s as in the run (both services fsync to one disk): how much of the end-to-end latency
/// the services' own contention explains. Returns (floor, floor under load).
async fn quorum_floors(
    env: &BenchEnv,
    duration: Duration,
) -> anyhow::Result<(Histogram<u64>, Histogram<u64>)> {
    let floor_q = env.quorum_queue("e2e-floor", "floor.quorum").await?;
    let floor_time = duration.min(Duration::from_secs(10));
    let floor =
        measure_publish_to_delivery(env, &floor_q, "floor.quorum", floor_time, 1000).await?;
    let load = spawn_commit_load(env, floor_time, 1000, "bench.load", None);
    let floor_loaded =
        measure_publish_to_delivery(env, &floor_q, "floor.quorum", floor_time, 1000).await?;
    for l in load {
        l.await??;
    }
    env.reset_outbox().await?;
    env.delete_queue(&floor_q).await;
    Ok((floor, floor_loaded))
}
