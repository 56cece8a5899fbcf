//! The ceilings every ratio is measured against: persistent publishes with confirms of the relay's message shape, and claim-and-delete in PostgreSQL.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::*;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation};
use std::time::Instant;

/// What the ceiling publishes: bare messages (a reference) or the relay's own message shape
/// (properties and headers, sent by the relay's publisher code, no database), the ceiling the
/// relay is held to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Bare,
    RelayShaped,
}

impl Shape {
    fn label(self) -> &'static str {
        match self {
            Shape::Bare => "bare",
            Shape::RelayShaped => "relay-shaped",
        }
    }
}

/// The confirm windows the ceiling tries; the best is the ceiling.
pub(crate) const WINDOWS: [usize; 3] = [256, 1000, 2000];

/// Raw lapin: persistent publishes with confirms to a durable queue, windows of 256, 1000 and 2000.
pub(crate) async fn ceiling_amqp(env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
    let n = env.n(50_000, 500);
    let q = env.queue("ceiling", "ceiling.#").await?;
    let mut best = 0.0f64;
    let mut lines = Vec::new();
    for shape in [Shape::Bare, Shape::RelayShaped] {
        for window in WINDOWS {
            let cpu = env::CpuSnapshot::take();
            let rate = publish_rate(env, &q, shape, window, n).await?;
            lines.push(
                Line::new(
                    &format!("ceiling-amqp ({}, window {window})", shape.label()),
                    rate,
                    "msg/s",
                )
                .note(env::CpuSnapshot::take().report_since(&cpu, n)),
            );
            if shape == Shape::RelayShaped {
                best = best.max(rate);
            }
        }
    }
    env.delete_queue(&q).await;
    c.amqp = Some(best);
    lines.push(Line::new("ceiling-amqp", best, "msg/s").note(format!(
        "{n} persistent publishes with confirms of the relay's message shape, best window"
    )));
    Ok(lines)
}

/// One relay-shaped ceiling measurement: its rate, the confirm window it used and the CPU use
/// while it ran (to set beside a drain's).
pub(crate) struct CeilingTrial {
    pub rate: f64,
    pub window: usize,
    pub cpu: String,
}

/// The relay-shaped ceiling measured now (`n` publishes at each window, the best kept): a scenario
/// that runs long takes its own just before each measurement, so drift on a shared machine hits
/// both alike.
pub(crate) async fn relay_shaped_now(env: &BenchEnv, n: u64) -> anyhow::Result<CeilingTrial> {
    let mut best: Option<CeilingTrial> = None;
    for window in WINDOWS {
        let trial = relay_shaped_at(env, n, window).await?;
        if best.as_ref().is_none_or(|b| trial.rate > b.rate) {
            best = Some(trial);
        }
    }
    best.ok_or_else(|| anyhow::anyhow!("no window to measure"))
}

/// The relay-shaped ceiling at one confirm window.
pub(crate) async fn relay_shaped_at(
    env: &BenchEnv,
    n: u64,
    window: usize,
) -> anyhow::Result<CeilingTrial> {
    let q = env.queue("ceiling-now", "ceiling.#").await?;
    let cpu = env::CpuSnapshot::take();
    let rate = publish_rate(env, &q, Shape::RelayShaped, window, n).await;
    let cpu = env::CpuSnapshot::take().report_since(&cpu, n);
    env.delete_queue(&q).await;
    Ok(CeilingTrial {
        rate: rate?,
        window,
        cpu,
    })
}

/// Publishes `n` messages of `shape` with at most `window` unconfirmed, then purges `queue`;
/// returns messages per second.
async fn publish_rate(
    env: &BenchEnv,
    queue: &str,
    shape: Shape,
    window: usize,
    n: u64,
) -> anyhow::Result<f64> {
    let ch = env.conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = payload(1).to_string().into_bytes();
    let mut publisher = relay::publisher::Publisher::new(&env.amqp_url, &env.exchange, true);
    publisher.ensure_connected().await?;
    let started = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    let mut i = 0u64;
    while i < n {
        // Wait for room, then take every confirm that is already in: the broker confirms in bulk,
        // so the room comes in batches too.
        while in_flight.len() >= window {
            if let Some(r) = in_flight.next().await {
                acked(r)?;
            }
            while let Some(Some(r)) = futures::FutureExt::now_or_never(in_flight.next()) {
                acked(r)?;
            }
        }
        // Hand lapin the whole batch at once, as the relay does: one write by its I/O thread for
        // all of them instead of a thread hand-off per publish.
        let room = ((window - in_flight.len()) as u64).min(n - i);
        let confirms = match shape {
            Shape::Bare => {
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
            }
            Shape::RelayShaped => relay_shaped_batch(&publisher, i..i + room).await?,
        };
        for c in confirms {
            in_flight.push(c?);
        }
        i += room;
    }
    while let Some(r) = in_flight.next().await {
        acked(r)?;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    publisher.disconnect().await;
    // Both channels closed: this runs twice before every skew drain, on the bench's one
    // connection.
    ch.close(200, "done".into()).await?;
    let purge = env.conn.create_channel().await?;
    purge.queue_purge(queue.into(), Default::default()).await?;
    purge.close(200, "done".into()).await?;
    Ok(rate)
}

fn acked(r: Result<Confirmation, lapin::Error>) -> anyhow::Result<()> {
    anyhow::ensure!(matches!(r?, Confirmation::Ack(None)), "publish not acked");
    Ok(())
}

/// Rows `ks` in the relay's shape, encoded by the relay's encoder and sent by its publisher.
async fn relay_shaped_batch(
    publisher: &relay::publisher::Publisher,
    ks: std::ops::Range<u64>,
) -> anyhow::Result<Vec<Result<lapin::PublisherConfirm, lapin::Error>>> {
    let rows: Vec<relay::store::OutboxRow> = ks
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
    Ok(futures::future::join_all(
        rows.iter()
            .zip(encoded)
            .map(|(row, e)| publisher.send(e, row.payload.as_bytes())),
    )
    .await)
}

/// Raw claim-and-delete of outbox-shaped rows in batches of 1000, the statement shape the relay uses.
pub(crate) async fn ceiling_pg(env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
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
