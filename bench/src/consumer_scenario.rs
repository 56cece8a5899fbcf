//! The consumer (dedup + effect) against raw consume+ack of the same messages, and the queue helpers the consumer scenarios share.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::*;
use anyhow::Context;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use std::time::{Duration, Instant};

/// Publishes `n` ledger events (`payment.captured`) to the exchange with confirms.
pub(crate) async fn publish_ledger_events(
    env: &BenchEnv,
    n: u64,
    routing_key: &str,
) -> anyhow::Result<()> {
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

/// Publishes `n` events with routing key `key` and header `tenant` to the exchange, with
/// confirms (the fair share scenario's traffic).
pub(crate) async fn publish_tenant_events(
    env: &BenchEnv,
    key: &str,
    tenant: &str,
    n: u64,
) -> anyhow::Result<()> {
    let ch = env.conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut in_flight = FuturesUnordered::new();
    for i in 0..n {
        while in_flight.len() >= 1000 {
            let r: Result<Confirmation, lapin::Error> = in_flight.next().await.unwrap();
            anyhow::ensure!(matches!(r?, Confirmation::Ack(None)), "publish not acked");
        }
        let mut headers = FieldTable::default();
        for (k, v) in [("aggregate_type", "account"), ("tenant", tenant)] {
            headers.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
        }
        headers.insert(
            "aggregate_id".into(),
            lapin::types::AMQPValue::LongString(format!("{tenant}-{i}").into()),
        );
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_type(key.into())
            .with_message_id(uuid::Uuid::now_v7().to_string().into())
            .with_headers(headers);
        let body = payload(i).to_string();
        let confirm = ch
            .basic_publish(
                env.exchange.as_str().into(),
                key.into(),
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

pub(crate) fn consumer_topology(name: &str) -> consumer::Topology {
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

pub(crate) async fn ledger_updates(env: &BenchEnv) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT coalesce(sum(updates), 0)::bigint FROM demo.ledger_balances")
            .fetch_one(&env.pool)
            .await?,
    )
}

/// Raw consume+ack from a quorum queue vs the ledger consumer (dedup + effect) on the same messages.
pub(crate) async fn consumer(env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
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
