//! A relay in the test's own process, or the `relay` binary as a child process, with settings
//! that make failures show quickly.

use crate::{TestDb, amqp_url, bin_path, free_addr};
use plumbing::config::Connections;
use plumbing::telemetry::Readiness;
use relay::{RelayConfig, RelayOptions};
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// Short lease, poll, confirm timeout and retry backoff.
pub fn test_options() -> RelayOptions {
    RelayOptions {
        lease_ms: 2000,
        poll_interval_ms: 100,
        confirm_timeout_ms: 800,
        retry_base_ms: 50,
        retry_max_ms: 200,
        stats_interval_ms: 200,
        ..RelayOptions::default()
    }
}

/// [`test_options`] for a test that injects no failure and asserts "once each": an 800 ms confirm
/// or a 2 s lease can run out on a loaded CI machine, and the relay rightly answers that with
/// publishing again (at least once), which such a test would take for a bug. Leases still move
/// between relays by rebalancing (a relay gives back its surplus), not by expiring.
pub fn patient_options() -> RelayOptions {
    RelayOptions {
        lease_ms: 30_000,
        confirm_timeout_ms: 10_000,
        ..test_options()
    }
}

/// [`patient_options`] as the `relay` binary's flags.
pub const PATIENT_FLAGS: [&str; 12] = [
    "--lease-ms",
    "30000",
    "--poll-interval-ms",
    "100",
    "--confirm-timeout-ms",
    "10000",
    "--retry-base-ms",
    "50",
    "--retry-max-ms",
    "200",
    "--stats-interval-ms",
    "200",
];

/// [`test_options`] as the `relay` binary's flags.
pub const FAST_FLAGS: [&str; 12] = [
    "--lease-ms",
    "2000",
    "--poll-interval-ms",
    "100",
    "--confirm-timeout-ms",
    "800",
    "--retry-base-ms",
    "50",
    "--retry-max-ms",
    "200",
    "--stats-interval-ms",
    "200",
];

/// The `relay` binary publishing `db_url`'s outbox to `exchange` on `amqp_url`, metrics on
/// `metrics`, warnings only, stdout dropped, killed when dropped. No flags yet: add them (for
/// example [`FAST_FLAGS`]) and the test's own settings, then spawn.
pub fn relay_command(db_url: &str, amqp_url: &str, exchange: &str, metrics: SocketAddr) -> Command {
    let mut cmd = Command::new(bin_path("relay"));
    cmd.env("DATABASE_URL", db_url)
        .env("AMQP_URL", amqp_url)
        .env("OUTBOX_EXCHANGE", exchange)
        .env("METRICS_ADDR", metrics.to_string())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// [`relay_command`] with `flags`, started.
pub fn spawn_relay(
    db_url: &str,
    amqp_url: &str,
    exchange: &str,
    metrics: SocketAddr,
    flags: &[&str],
) -> Child {
    relay_command(db_url, amqp_url, exchange, metrics)
        .args(flags)
        .spawn()
        .expect("spawn relay")
}

/// Runs the `relay` command line (`dead list`, `dead requeue --all`, ...) on `db_url`'s outbox
/// and returns what it printed and its status.
pub fn relay_cli(db_url: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(bin_path("relay"))
        .args(args)
        .env("DATABASE_URL", db_url)
        .output()
        .expect("run relay")
}

pub fn config(db_url: &str, amqp_url: &str, exchange: &str, options: RelayOptions) -> RelayConfig {
    RelayConfig {
        connections: Connections {
            database_url: db_url.to_string(),
            schema: Default::default(),
            amqp_url: amqp_url.to_string(),
            amqp_tls: Default::default(),
            database_direct_url: None,
            database_pooler: Default::default(),
            exchange: exchange.to_string(),
            metrics_addr: free_addr(),
            otlp_endpoint: None,
        },
        options,
    }
}

/// A relay running in this process.
pub struct InProcess {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), relay::RelayError>>,
    pub readiness: Arc<Readiness>,
}

impl InProcess {
    pub async fn start(pool: sqlx::PgPool, config: RelayConfig) -> Self {
        let stop = CancellationToken::new();
        let readiness = Readiness::new();
        let handle = tokio::spawn(relay::run_with_pool(
            pool,
            config,
            readiness.clone(),
            stop.clone(),
        ));
        Self {
            stop,
            handle,
            readiness,
        }
    }
    /// A relay on `db` publishing to `exchange` on the shared RabbitMQ, with `options`.
    pub async fn on(db: &TestDb, exchange: &str, options: RelayOptions) -> Self {
        Self::start(
            db.pool.clone(),
            config(&db.url, &amqp_url(), exchange, options),
        )
        .await
    }

    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.handle)
            .await
            .expect("relay stops in time")
            .unwrap()
            .unwrap();
    }
}
