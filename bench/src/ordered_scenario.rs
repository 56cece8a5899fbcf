//! Ordered consumers against the same consumer unordered: `producer timeline` (one multi-row
//! insert per batch) drains the same backlog, published by the relay, in both modes, over 1,000
//! aggregates and over one.

use crate::consumer_scenario::{delete_consumer_topology, wait_queue_consumed};
use crate::env::{self, BenchEnv};
use crate::report::Line;
use crate::scenarios::{payload, pending};
use shared::NewMessage;
use std::time::{Duration, Instant};

/// `consumer-ordered`: the ratios issue 22 asks for (ordered ≥ 70 % of unordered at 1,000
/// aggregates, ≥ 40 % with all traffic on one aggregate).
pub async fn consumer_ordered(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(20_000, 500);
    let mut lines = Vec::new();
    for (aggregates, target) in [(1000u64, 0.7), (1, 0.4)] {
        let plural = if aggregates == 1 { "" } else { "s" };
        let run = |ordered| Drain {
            n,
            aggregates,
            ordered,
            instances: 1,
            cluster: None,
        };
        let unordered = drain(env, &run(false)).await?;
        let ordered = drain(env, &run(true)).await?;
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

/// One drain: `n` messages over `aggregates`, by `instances` consumer processes, ordered or not,
/// on the bench's broker or on `cluster`.
struct Drain<'a> {
    n: u64,
    aggregates: u64,
    ordered: bool,
    instances: usize,
    cluster: Option<&'a Cluster>,
}

/// A RabbitMQ cluster of the bench's own nodes (removed when dropped).
pub struct Cluster {
    /// Every node's URL, comma-separated (`AMQP_URL` of the processes).
    url: String,
    conn: lapin::Connection,
    _nodes: Vec<system_tests::private_rabbit::RabbitNode>,
}

impl Cluster {
    /// Starts `size` nodes (a few tens of seconds on 2 cores) and joins them.
    async fn start(size: usize) -> anyhow::Result<Self> {
        let names: Vec<String> = (0..size).map(|i| format!("bench{i}")).collect();
        let nodes = tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            system_tests::private_rabbit::start_cluster(&refs, &[])
        })
        .await?;
        let url = nodes
            .iter()
            .map(|n| n.amqp_url())
            .collect::<Vec<_>>()
            .join(",");
        let conn =
            plumbing::amqp::connect(&nodes[0].amqp_url(), &Default::default(), "bench cluster")
                .await?;
        Ok(Self {
            url,
            conn,
            _nodes: nodes,
        })
    }
}

/// `consumer-ordered-scale`: 4 ordered instances against one, on a 3-node quorum-queue cluster of
/// the bench's own (issue 22: ≥ 2.5×, "if the 2 cores allow a meaningful figure").
pub async fn consumer_ordered_scale(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let n = env.n(20_000, 500);
    let cluster = Cluster::start(3).await?;
    let run = |instances| Drain {
        n,
        aggregates: 1000,
        ordered: true,
        instances,
        cluster: Some(&cluster),
    };
    let one = drain(env, &run(1)).await?;
    let four = drain(env, &run(4)).await?;
    Ok(vec![
        Line::new("consumer timeline ordered, 1 instance (3-node cluster)", one, "msg/s").note(
            format!("{n} messages over 1,000 aggregates published by the relay to a 3-node cluster of the bench's own nodes (quorum partition queues, 3 replicas), then drained by one `producer timeline --ordered --lease 2s`"),
        ),
        Line::new("consumer timeline ordered, 4 instances (3-node cluster)", four, "msg/s")
            .vs_ceiling(one, Some(2.5))
            .note(format!(
                "the same with 4 instances sharing the 8 partitions (2 each once spread; the spread happens during the drain); ceiling = one instance; {} cores on this machine",
                std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
            )),
    ])
}

/// Declares the consumer (start, stop), lets the relay publish the messages into its queues,
/// then times the consumer instances draining them (from the first effect to the last).
async fn drain(env: &BenchEnv, d: &Drain<'_>) -> anyhow::Result<f64> {
    env.reset_outbox().await?;
    let name = consumer_name(env, d);
    let mut args = vec!["timeline", "--name", name.as_str(), "--bind", "#"];
    if d.ordered {
        args.push("--ordered");
    }
    if d.cluster.is_some() {
        // Both cluster runs: a spread over 4 instances settles within a few seconds.
        args.extend(["--lease", "2s"]);
    }
    let amqp: Vec<(&str, &str)> = match d.cluster {
        Some(c) => vec![("AMQP_URL", c.url.as_str())],
        None => Vec::new(),
    };
    let conn = d.cluster.map(|c| &c.conn).unwrap_or(&env.conn);
    let probe = if d.ordered {
        consumer::ordered::topology::queue(&name, 0)
    } else {
        name.clone()
    };
    let first = env.spawn("producer", &args, &amqp)?;
    wait_queue_consumed(conn, &probe).await?;
    env::stop(first).await;

    publish_backlog(env, d, &name, &amqp).await?;
    let rate = time_consumers(env, d, &name, &args, &amqp).await?;
    if d.ordered {
        let v = demo::timeline::violations(&env.pool, &name).await?;
        anyhow::ensure!(
            v == demo::timeline::Violations::default(),
            "{name}: {v:?} in demo.timeline"
        );
    }
    if d.cluster.is_none() {
        // The cluster goes with its nodes; the bench's broker keeps what is not deleted.
        delete_topology(env, d.ordered, &name).await;
    }
    Ok(rate)
}

/// Each run its own consumer name (and so its own rows in demo.timeline): the cluster's one
/// instance once shared the name, and the rows, of consumer-ordered's run on the local broker.
fn consumer_name(env: &BenchEnv, d: &Drain<'_>) -> String {
    let mode = match (d.ordered, d.cluster.is_some()) {
        (false, _) => "u",
        (true, false) => "o",
        (true, true) => "oc",
    };
    format!(
        "{}-tl-{mode}{}-{}",
        env.exchange.replace('.', "-"),
        d.aggregates,
        d.instances
    )
}

/// Enqueues the `n` messages (1,000 a transaction) and runs a relay until none is pending, so
/// the drain that follows reads a full queue and times the consumer alone. Aggregates are named
/// after the run, so their numbers start at 1 for this consumer.
async fn publish_backlog(
    env: &BenchEnv,
    d: &Drain<'_>,
    name: &str,
    amqp: &[(&str, &str)],
) -> anyhow::Result<()> {
    let mut done = 0;
    while done < d.n {
        let k = (d.n - done).min(1000);
        let msgs: Vec<NewMessage> = (done..done + k)
            .map(|i| {
                NewMessage::new(
                    "bench",
                    format!("{name}-{}", i % d.aggregates),
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
    let relay = env.spawn("relay", &[], amqp)?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while pending(env).await? > 0 {
        anyhow::ensure!(Instant::now() < deadline, "relay did not publish in 300 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env::stop(relay).await;
    env.settle().await?;
    Ok(())
}

/// Starts the consumer instances, waits until every message has its effect, stops them and
/// returns messages/s from the first effect to the last.
async fn time_consumers(
    env: &BenchEnv,
    d: &Drain<'_>,
    name: &str,
    args: &[&str],
    amqp: &[(&str, &str)],
) -> anyhow::Result<f64> {
    let n = d.n;
    let mut consumers = Vec::new();
    for _ in 0..d.instances {
        consumers.push(env.spawn("producer", args, amqp)?);
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let applied: i64 =
            sqlx::query_scalar("SELECT count(*) FROM demo.timeline WHERE consumer = $1")
                .bind(name)
                .fetch_one(&env.pool)
                .await?;
        if applied as u64 >= n {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{name} did not finish in 600 s ({applied} of {n})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // From the first effect to the last, by the effects' own times: a poll that stalls on a busy
    // machine (one saw all 20,000 at once) cannot bend it.
    let (applied, span): (i64, f64) = sqlx::query_as(
        "SELECT count(*), coalesce(extract(epoch FROM max(applied_at) - min(applied_at)), 0)::float8 \
         FROM demo.timeline WHERE consumer = $1",
    )
    .bind(name)
    .fetch_one(&env.pool)
    .await?;
    let rate = (applied - 1).max(0) as f64 / span.max(1e-6);
    for c in consumers {
        env::stop(c).await;
    }
    Ok(rate)
}

/// Deletes the consumer's queues and exchanges from the bench's broker (the ordered mode's
/// partition queues and exchanges too).
pub(crate) async fn delete_topology(env: &BenchEnv, ordered: bool, name: &str) {
    if ordered {
        let (queues, exchanges) =
            consumer::ordered::topology::names(name, consumer::config::DEFAULT_PARTITIONS);
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
    delete_consumer_topology(env, name).await;
}
