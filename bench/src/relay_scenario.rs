//! The relay draining a committed backlog, with one and with two relays.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::*;
use std::time::{Duration, Instant};

pub(crate) async fn wait_partitions_split(env: &BenchEnv, relays: i64) -> anyhow::Result<()> {
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
pub(crate) async fn relay_drain(env: &BenchEnv, c: &Ceilings) -> anyhow::Result<Vec<Line>> {
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
        let (rate, cpu_note) = crate::relay_scenario::timed_drain(env, n).await?;
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

/// Waits (at most 300 s) until the `n` rows just committed are all published; their rate, and
/// the CPU each process spent per 1,000 of them.
pub(crate) async fn timed_drain(env: &BenchEnv, n: u64) -> anyhow::Result<(f64, String)> {
    let cpu = env::CpuSnapshot::take();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(300);
    while pending(env).await? > 0 {
        anyhow::ensure!(Instant::now() < deadline, "backlog not drained in 300 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    Ok((rate, env::CpuSnapshot::take().report_since(&cpu, n)))
}
