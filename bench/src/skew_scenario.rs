//! Key skew: the relay draining backlogs spread over 1 to 10,000 aggregates and over Zipf-skewed
//! keys.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::{Ceilings, median, payload};
use rand::{Rng, SeedableRng};
use shared::NewMessage;
use std::time::{Duration, Instant};

/// How a backlog's rows are spread over aggregates.
#[derive(Debug, Clone, Copy)]
enum Keys {
    /// Round robin over this many aggregates.
    Uniform(u64),
    /// Zipf over this many aggregates with exponent `s` (rank k has weight 1/k^s).
    Zipf(u64, f64),
}

impl Keys {
    fn label(self) -> String {
        match self {
            Keys::Uniform(n) => format!("{n} aggregate{}", if n == 1 { "" } else { "s" }),
            Keys::Zipf(n, s) => format!("{n} aggregates, Zipf s={s}"),
        }
    }

    /// The aggregate of each of `n` rows (deterministic).
    fn draw(self, n: u64) -> Vec<u64> {
        match self {
            Keys::Uniform(k) => (0..n).map(|i| i % k).collect(),
            Keys::Zipf(k, s) => {
                let weights: Vec<f64> = (1..=k).map(|r| 1.0 / (r as f64).powf(s)).collect();
                let total: f64 = weights.iter().sum();
                let mut cdf = Vec::with_capacity(weights.len());
                let mut acc = 0.0;
                for w in weights {
                    acc += w / total;
                    cdf.push(acc);
                }
                let mut rng = rand::rngs::StdRng::seed_from_u64(11);
                (0..n)
                    .map(|_| {
                        let u: f64 = rng.random();
                        cdf.partition_point(|c| *c < u).min(cdf.len() - 1) as u64
                    })
                    .collect()
            }
        }
    }
}

/// The share of rows on the hottest aggregate and on the 10 hottest, and how many aggregates.
fn distribution(keys: &[u64]) -> String {
    let mut counts = std::collections::HashMap::<u64, u64>::new();
    for k in keys {
        *counts.entry(*k).or_default() += 1;
    }
    let mut sorted: Vec<u64> = counts.values().copied().collect();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let n = keys.len().max(1) as f64;
    let top10: u64 = sorted.iter().take(10).sum();
    format!(
        "{} aggregates with rows; hottest {:.1}% of rows, 10 hottest {:.1}%",
        sorted.len(),
        sorted.first().copied().unwrap_or(0) as f64 * 100.0 / n,
        top10 as f64 * 100.0 / n
    )
}

/// How many times each distribution is drained, each drain right after a ceiling measurement.
const TRIALS: usize = 3;

/// One relay drains a committed backlog for each key distribution, [`TRIALS`] times, each drain
/// right after a relay-shaped ceiling measured on the same quiet machine: a drain of 100,000 rows
/// takes long enough that a shared machine drifts between one ceiling at the start of the run and
/// the fifth drain. The ceiling publishes as many messages as the drain, into the same kind of
/// queue, which they fill as the drain's do (a shorter one, 30,000, was 5-10% faster and varied
/// twice as much).
///
/// The first ceiling tries every window and the later ones use the best of them. The ratio is the
/// median drain over the median ceiling: single measurements of either vary by ±10% from one
/// minute to the next on a 2-core machine, and the best of three windows measured once each is the
/// highest of three noisy samples, a ceiling no single measurement of the same publisher reaches
/// on average. The first pair alone (one ceiling at its best window, one drain: how this scenario
/// measured before) is in the note too.
pub async fn relay_skew(env: &BenchEnv, c: &Ceilings) -> anyhow::Result<Vec<Line>> {
    let n = env.n(100_000, 2000);
    let mut lines = Vec::new();
    for keys in [
        Keys::Uniform(1),
        Keys::Uniform(10),
        Keys::Uniform(100),
        Keys::Uniform(10_000),
        Keys::Zipf(10_000, 1.1),
    ] {
        let drawn = keys.draw(n);
        let mut ceilings: Vec<crate::ceiling_scenario::CeilingTrial> = Vec::new();
        let mut drains = Vec::new();
        for _ in 0..TRIALS {
            env.reset_outbox().await?;
            // The ceiling starts from the same quiet broker as the drain: the last drain's
            // 100,000 messages were just deleted, and the broker's cleanup of them would slow the
            // ceiling (and flatter the ratio).
            env.settle().await?;
            let ceiling = match ceilings.first() {
                None => crate::ceiling_scenario::relay_shaped_now(env, n).await?,
                Some(first) => {
                    crate::ceiling_scenario::relay_shaped_at(env, n, first.window).await?
                }
            };
            ceilings.push(ceiling);
            drains.push(drain_once(env, &drawn).await?);
        }
        lines.push(skew_line(keys, &drawn, &ceilings, &drains, c));
    }
    Ok(lines)
}

/// One drain: a relay that is running and holds its partitions, a backlog of `drawn` keys committed
/// in one transaction, timed from that commit until the outbox is empty.
async fn drain_once(env: &BenchEnv, drawn: &[u64]) -> anyhow::Result<Drain> {
    let n = drawn.len() as u64;
    let q = env.queue("skew", "bench.skew").await?;
    // The relay starts and takes its partitions first, as in relay-drain: what is timed is the
    // drain, from the commit that makes the whole backlog visible at once.
    env.settle().await?;
    let relay = env.spawn_relay(&[])?;
    let spawned = Instant::now();
    crate::relay_scenario::wait_partitions_split(env, 1).await?;
    let start_up = spawned.elapsed();
    let mut tx = env.pool.begin().await?;
    for (i, chunk) in drawn.chunks(1000).enumerate() {
        let rows: Vec<NewMessage> = chunk
            .iter()
            .enumerate()
            .map(|(j, k)| {
                let at = (i * 1000 + j) as u64;
                NewMessage::new("bench", format!("agg-{k}"), "bench.skew", payload(at))
            })
            .collect();
        shared::outbox::enqueue_many(&mut *tx, &rows).await?;
    }
    tx.commit().await?;
    let (rate, cpu) = crate::relay_scenario::timed_drain(env, n).await?;
    env::stop(relay).await;
    env.delete_queue(&q).await;
    Ok(Drain {
        rate,
        cpu,
        start_up,
    })
}

struct Drain {
    rate: f64,
    cpu: String,
    start_up: Duration,
}

fn skew_line(
    keys: Keys,
    drawn: &[u64],
    ceilings: &[crate::ceiling_scenario::CeilingTrial],
    drains: &[Drain],
    c: &Ceilings,
) -> Line {
    let ceiling = median(ceilings.iter().map(|t| t.rate).collect());
    let rate = median(drains.iter().map(|d| d.rate).collect());
    let pairs = ceilings
        .iter()
        .zip(drains)
        .map(|(t, d)| {
            format!(
                "{:.0}/{:.0} ({:.0}%)",
                d.rate,
                t.rate,
                d.rate * 100.0 / t.rate
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let run_ceiling = c
        .amqp
        .map(|r| format!("; the run's ceiling-amqp: {r:.0} msg/s"))
        .unwrap_or_default();
    let (first_ceiling, first_drain) = (&ceilings[0], &drains[0]);
    let windows = crate::ceiling_scenario::WINDOWS
        .map(|w| w.to_string())
        .join("/");
    Line::new(&format!("relay-skew ({})", keys.label()), rate, "msg/s")
        .vs_ceiling(ceiling, Some(0.85))
        .note(format!(
            "{n} rows committed in one transaction, drained by 1 relay that was running (its start and lease claim took {:.2} s before), {trials} times, each right after a ceiling of as many relay-shaped publishes (best of windows {windows} first, then window {window}); median drain over median ceiling; drain/ceiling per trial: {pairs}; {dist}; first ceiling: {}; first drain: {}{run_ceiling}",
            first_drain.start_up.as_secs_f64(),
            first_ceiling.cpu,
            first_drain.cpu,
            n = drawn.len(),
            trials = drains.len(),
            window = first_ceiling.window,
            dist = distribution(drawn),
        ))
}
