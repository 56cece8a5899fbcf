//! Ordered consumers against the same consumer unordered: `producer timeline` (one multi-row
//! insert per batch) drains the same backlog, published by the relay, in both modes, over 1,000
//! aggregates and over one.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::{delete_consumer_topology, payload, pending, wait_queue_exists};
use shared::NewMessage;
use std::time::{Duration, Instant};

/// `consumer-ordered`: the ratios issue 22 asks for (ordered ≥ 70 % of unordered at 1,000
/// aggregates, ≥ 40 % with all traffic on one aggregate).
pub async fn consumer_ordered(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(20_000, 500);
    let mut lines = Vec::new();
    for (aggregates, target) in [(1000u64, 0.7), (1, 0.4)] {
        let plural = if aggregates == 1 { "" } else { "s" };
        let unordered = drain(env, n, aggregates, false).await?;
        let ordered = drain(env, n, aggregates, true).await?;
        lines.push(
            Line::new(
                &format!("consumer timeline unordered ({aggregates} aggregate{plural})"),
                unordered,
                "msg/s",
            )
            .note(format!(
                "{n} messages published by the relay into the stopped consumer's queue, then drained; default settings (2 workers)"
            )),
        );
        lines.push(
            Line::new(
                &format!("consumer timeline ordered ({aggregates} aggregate{plural})"),
                ordered,
                "msg/s",
            )
            .vs_ceiling(unordered, Some(target))
            .note(
                "the same messages, --ordered (8 partition queues, one instance), each aggregate checked in order and once; ceiling = the same consumer unordered",
            ),
        );
    }
    Ok(lines)
}

/// Declares the consumer (start, stop), lets the relay publish `n` messages over `aggregates`
/// into its queues, then times the consumer draining them (from its first effect to its last).
async fn drain(env: &BenchEnv, n: u64, aggregates: u64, ordered: bool) -> anyhow::Result<f64> {
    env.reset_outbox().await?;
    let mode = if ordered { "o" } else { "u" };
    let name = format!("{}-tl-{mode}{aggregates}", env.exchange.replace('.', "-"));
    let mut args = vec!["timeline", "--name", name.as_str(), "--bind", "#"];
    if ordered {
        args.push("--ordered");
    }
    let probe = if ordered {
        consumer::ordered::topology::queue(&name, 0)
    } else {
        name.clone()
    };
    let first = env.spawn("producer", &args, &[])?;
    wait_queue_exists(env, &probe).await?;
    env::stop(first).await;

    // Aggregates named after the run, so their numbers start at 1 for this consumer.
    let mut done = 0;
    while done < n {
        let k = (n - done).min(1000);
        let msgs: Vec<NewMessage> = (done..done + k)
            .map(|i| {
                NewMessage::new(
                    "bench",
                    format!("{name}-{}", i % aggregates),
                    "bench.timeline",
                    payload(i),
                )
            })
            .collect();
        let mut tx = env.pool.begin().await?;
        shared::outbox::enqueue_many(&mut *tx, &msgs).await?;
        tx.commit().await?;
        done += k;
    }
    let relay = env.spawn_relay(&[])?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while pending(env).await? > 0 {
        anyhow::ensure!(Instant::now() < deadline, "relay did not publish in 300 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env::stop(relay).await;
    env.settle().await?;

    let consumer = env.spawn("producer", &args, &[])?;
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut t0 = None;
    loop {
        let applied: i64 =
            sqlx::query_scalar("SELECT count(*) FROM demo.timeline WHERE consumer = $1")
                .bind(&name)
                .fetch_one(&env.pool)
                .await?;
        if applied > 0 && t0.is_none() {
            t0 = Some((Instant::now(), applied));
        }
        if applied as u64 >= n {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{name} did not finish in 600 s ({applied} of {n})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (t0, first) = t0.ok_or_else(|| anyhow::anyhow!("no progress"))?;
    let rate = (n - first as u64) as f64 / t0.elapsed().as_secs_f64().max(1e-6);
    env::stop(consumer).await;
    if ordered {
        let v = demo::timeline::violations(&env.pool, &name).await?;
        anyhow::ensure!(
            v == demo::timeline::Violations::default(),
            "{name}: {v:?} in demo.timeline"
        );
        let (queues, exchanges) =
            consumer::ordered::topology::names(&name, consumer::config::DEFAULT_PARTITIONS);
        for q in queues {
            env.delete_queue(&q).await;
        }
        if let Ok(ch) = env.conn.create_channel().await {
            for e in exchanges {
                let _ = ch
                    .exchange_delete(e.as_str().into(), Default::default())
                    .await;
            }
        }
    }
    delete_consumer_topology(env, &name).await;
    Ok(rate)
}
