//! `producer worker`: runs the payment processes that `POST /payments` started, against the
//! payment provider (`PROVIDER_URL`), with the processes crate's [`processes::Worker`].

use crate::Config;
use crate::payment_process::{self, PaymentFlow};
use payment_provider::client::Client;
use processes::{Registry, RetryPolicy, Worker, WorkerConfig};
use std::net::SocketAddr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Flags of `producer worker` (with env var fallbacks).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerSettings {
    /// Base URL of the payment provider.
    #[arg(long, env = "PROVIDER_URL", default_value = "http://127.0.0.1:8090")]
    pub provider_url: String,
    /// Limit of one provider call in milliseconds; past it the outcome is unknown (never a failure).
    #[arg(long, env = "PROVIDER_CALL_TIMEOUT_MS", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(50..=600_000))]
    pub provider_call_timeout_ms: u64,
    /// Attempts of the charge (and of the refund), the first included.
    #[arg(long, env = "CHARGE_MAX_ATTEMPTS", default_value_t = 10,
          value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub charge_max_attempts: i32,
    /// Delay before the second attempt in milliseconds (doubling, full jitter).
    #[arg(long, env = "CHARGE_RETRY_INITIAL_MS", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub charge_retry_initial_ms: u64,
    /// Upper bound of the retry delay in milliseconds.
    #[arg(long, env = "CHARGE_RETRY_MAX_DELAY_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub charge_retry_max_delay_ms: u64,
    /// No charge attempt starts later than this after the first, in seconds.
    #[arg(long, env = "CHARGE_DEADLINE_SECS", default_value_t = 3_600,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub charge_deadline_secs: u64,
    /// Unavailable answers in a row (503, 429, connection refused) that open the provider's
    /// circuit, shared by every worker: then the charges wait, no attempt spent, and one probe a
    /// cool-down asks the provider whether it is back.
    #[arg(long, env = "PROVIDER_CIRCUIT_THRESHOLD", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub provider_circuit_threshold: u32,
    /// The longest cool-down between two probes of a provider that is down (doubling from 2s).
    #[arg(long, env = "PROVIDER_CIRCUIT_MAX_COOLDOWN", default_value = "30s",
          value_parser = humantime::parse_duration)]
    pub provider_circuit_max_cooldown: Duration,
    /// Waiting payments resumed per second once the provider is back (oldest first).
    #[arg(long, env = "PROVIDER_RESUME_RATE", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub provider_resume_rate: u32,
    /// Most provider calls in flight at once across all workers (unset: no cap).
    #[arg(long, env = "PROVIDER_CONCURRENCY",
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub provider_concurrency: Option<u32>,
    /// Most provider calls a second across all workers, a token bucket of one second's burst
    /// (unset: no limit).
    #[arg(long, env = "PROVIDER_RATE",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub provider_rate: Option<u32>,
    /// How long a charge the provider accepted as pending (async mode) waits for its webhook
    /// before the provider is asked (e.g. `30s`, `10m`).
    #[arg(long, env = "PAYMENT_CONFIRMATION_TIMEOUT", default_value = "60s",
          value_parser = humantime::parse_duration)]
    pub payment_confirmation_timeout: Duration,
    /// Interval of the reconciliation with the provider (`0s` switches it off).
    #[arg(long, env = "RECONCILE_INTERVAL", default_value = "5m",
          value_parser = humantime::parse_duration)]
    pub reconcile_interval: Duration,
    /// A payment still pending after this is a reconciliation case.
    #[arg(long, env = "RECONCILE_PENDING_THRESHOLD", default_value = "1h",
          value_parser = humantime::parse_duration)]
    pub reconcile_pending_threshold: Duration,
    /// Payments younger than this are left to their process by the reconciliation.
    #[arg(long, env = "RECONCILE_SETTLE", default_value = "1m",
          value_parser = humantime::parse_duration)]
    pub reconcile_settle: Duration,
    /// Lease owner name; default `<hostname>-<pid>`.
    #[arg(long, env = "WORKER_ID")]
    pub worker_id: Option<String>,
    /// Processes worked on at once.
    #[arg(long, env = "WORKER_CONCURRENCY", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub worker_concurrency: u32,
    /// Lease of a claimed process in milliseconds: a killed worker's processes are taken over after it.
    #[arg(long, env = "WORKER_LEASE_MS", default_value_t = 15_000,
          value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub worker_lease_ms: u64,
    /// Heartbeat interval in milliseconds (shorter than the lease).
    #[arg(long, env = "WORKER_HEARTBEAT_MS", default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub worker_heartbeat_ms: u64,
    /// Fallback poll when no NOTIFY arrives, in milliseconds.
    #[arg(long, env = "WORKER_POLL_MS", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(10..=600_000))]
    pub worker_poll_ms: u64,
    /// On SIGTERM, how long a provider call in flight may still finish, in milliseconds.
    #[arg(long, env = "WORKER_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    pub worker_shutdown_grace_ms: u64,
    /// Address of /metrics, /healthz, /readyz.
    #[arg(long, env = "METRICS_ADDR", default_value = "127.0.0.1:9465")]
    pub metrics_addr: SocketAddr,
}

/// Why the worker could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerRunError {
    #[error(transparent)]
    Database(#[from] plumbing::db::DbError),
    #[error("cannot build the provider client")]
    Client(#[from] payment_provider::client::BuildError),
    #[error("invalid definition")]
    Definition(#[from] processes::definition::DefinitionError),
    #[error("cannot serve metrics on {addr}")]
    Ops {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Worker(#[from] processes::WorkerError),
    #[error("the provider's dependency settings cannot work")]
    Dependency(#[from] breaker::DeclareError),
}

impl WorkerSettings {
    /// The payment flow these settings describe.
    pub fn flow(&self, config: &Config) -> Result<PaymentFlow, WorkerRunError> {
        let call_timeout = Duration::from_millis(self.provider_call_timeout_ms);
        Ok(PaymentFlow {
            schema: config.schema.clone(),
            remote: config.payment_remote,
            provider: Some(Client::new(&self.provider_url, call_timeout)?),
            call_timeout,
            retry: RetryPolicy::default()
                .max_attempts(self.charge_max_attempts)
                .initial(Duration::from_millis(self.charge_retry_initial_ms))
                .max_delay(Duration::from_millis(self.charge_retry_max_delay_ms))
                .deadline(Some(Duration::from_secs(self.charge_deadline_secs))),
            confirmation_timeout: self.payment_confirmation_timeout,
            dependency: Some(self.provider_dependency()?),
        })
    }

    /// The provider as a dependency: its circuit and limits, shared by every worker.
    pub fn provider_dependency(&self) -> Result<breaker::Dependency, breaker::DeclareError> {
        let mut policy = breaker::Policy::default()
            .consecutive(self.provider_circuit_threshold)
            .cooldown(
                Duration::from_secs(2).min(self.provider_circuit_max_cooldown),
                self.provider_circuit_max_cooldown,
            )
            .resume_per_second(self.provider_resume_rate);
        if let Some(n) = self.provider_concurrency {
            policy = policy.concurrency(n);
        }
        if let Some(r) = self.provider_rate {
            policy = policy.rate(f64::from(r), r);
        }
        breaker::Dependency::new(payment_process::PROVIDER, policy)
    }
}

/// Connects (retrying), migrates, serves the ops routes and runs the payment worker until
/// `shutdown`; then finishes or abandons the current steps safely.
pub async fn run(
    config: Config,
    settings: WorkerSettings,
    shutdown: CancellationToken,
) -> Result<(), WorkerRunError> {
    let flow = settings.flow(&config)?;
    let mut registry = Registry::new();
    for d in payment_process::definitions(&flow) {
        registry = registry.with(d)?;
    }
    let concurrency = settings.worker_concurrency as usize;
    let pool =
        crate::connect_and_migrate(&config, concurrency as u32 + 4, "producer worker").await?;
    let readiness = plumbing::telemetry::Readiness::without_rabbitmq();
    let ops = CancellationToken::new();
    plumbing::telemetry::serve_ops(settings.metrics_addr, readiness.clone(), ops.clone())
        .await
        .map_err(|source| WorkerRunError::Ops {
            addr: settings.metrics_addr,
            source,
        })?;
    let worker_id = settings.worker_id.clone().unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".into());
        format!("{host}-{}", std::process::id())
    });
    let mut wc = WorkerConfig::new(pool.clone(), config.schema.clone(), worker_id);
    wc.concurrency = concurrency;
    wc.lease = Duration::from_millis(settings.worker_lease_ms);
    wc.heartbeat = Duration::from_millis(settings.worker_heartbeat_ms);
    wc.poll_interval = Duration::from_millis(settings.worker_poll_ms);
    wc.shutdown_grace = Duration::from_millis(settings.worker_shutdown_grace_ms);
    // Ready once a claim succeeded; not ready while claims fail (the database is away).
    wc.on_database = Some(processes::DatabaseHook(std::sync::Arc::new(move |up| {
        readiness.set_postgres(up)
    })));
    let reconciliation = (!settings.reconcile_interval.is_zero()).then(|| {
        let cfg = crate::reconciliation::ReconcileConfig {
            interval: settings.reconcile_interval,
            pending_threshold: settings.reconcile_pending_threshold,
            settle: settings.reconcile_settle,
            ..Default::default()
        };
        let provider = flow.provider.clone();
        let pool = pool.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            if let Some(provider) = provider {
                crate::reconciliation::run(pool, provider, cfg, stop).await;
            }
        })
    });
    let result = Worker::run(wc, registry, shutdown).await;
    if let Some(r) = reconciliation {
        let _ = r.await;
    }
    ops.cancel();
    pool.close().await;
    Ok(result?)
}
