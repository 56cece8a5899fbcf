//! A consumer running in the test's own process, and the broker objects a consumer declares,
//! tracked for deletion.

use crate::{TestBroker, bin_path, wait_until};
use consumer::{Config, Consumer, ConsumerError, Handlers, Stats};
use plumbing::telemetry::Readiness;
use sqlx::PgPool;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const LONG: Duration = Duration::from_secs(60);

/// A consumer running in this process. A test that fails mid-way must not leave it running (it
/// would re-declare its queues after the broker cleanup deleted them): dropping it stops it.
pub struct RunningConsumer {
    pub stats: Arc<Stats>,
    pub readiness: Arc<Readiness>,
    pub shutdown: CancellationToken,
    pub handle: Option<tokio::task::JoinHandle<Result<(), ConsumerError>>>,
}

impl Drop for RunningConsumer {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(h) = &self.handle {
            h.abort();
        }
    }
}

impl RunningConsumer {
    /// Starts it and waits until it consumes (RabbitMQ ready).
    pub async fn start(config: Config, pool: PgPool, handlers: Handlers) -> Self {
        let consumer = Consumer::new(config, pool, handlers).expect("valid config");
        let stats = consumer.stats();
        let readiness = consumer.readiness();
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(consumer.run(shutdown.clone()));
        let r = readiness.clone();
        wait_until("consumer consuming", LONG, || {
            let r = r.clone();
            async move { r.rabbitmq().then_some(()) }
        })
        .await;
        Self {
            stats,
            readiness,
            shutdown,
            handle: Some(handle),
        }
    }

    /// A graceful stop, which must end in time and without error.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        let handle = self.handle.take().expect("running");
        tokio::time::timeout(LONG, handle)
            .await
            .expect("consumer stops in time")
            .expect("consumer task")
            .expect("consumer run");
    }
}

/// One of the example application's consumers, `producer <subcommand>` (`ledger` or
/// `timeline`), named `name`, as a child process: on `db_url`'s database and `exchange` at
/// `amqp_url`, metrics on `metrics`, warnings only, stdout dropped, killed when dropped. The
/// test adds its bindings, retry delays and other flags, then spawns it.
pub fn example_consumer_command(
    subcommand: &str,
    name: &str,
    db_url: &str,
    amqp_url: &str,
    exchange: &str,
    metrics: SocketAddr,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin_path("producer"));
    cmd.args([subcommand, "--name", name])
        .args(["--database-url", db_url, "--amqp-url", amqp_url])
        .args([
            "--exchange",
            exchange,
            "--metrics-addr",
            &metrics.to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// How many messages consumer `consumer` has recorded as processed (its dedup rows).
pub async fn processed_rows(pool: &sqlx::PgPool, consumer: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox.processed_messages WHERE consumer = $1")
        .bind(consumer)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Remembers every queue and exchange consumer `name` declares (with `retry_delays`), and, for
/// an ordered consumer (`partitions`), its partition queues and headers exchange.
pub fn track_consumer(
    broker: &TestBroker,
    name: &str,
    retry_delays: &[Duration],
    partitions: Option<u16>,
) {
    let t = consumer::topology::Topology::new(name, retry_delays);
    let (mut queues, mut exchanges) = (t.queues(), t.exchanges());
    if let Some(n) = partitions {
        let (q, e) = consumer::ordered::topology::names(name, n);
        queues.extend(q);
        exchanges.extend(e);
    }
    for q in queues {
        broker.track_queue(&q);
    }
    for e in exchanges {
        broker.track_exchange(&e);
    }
}
