//! A process worker for the system tests: the test definitions of `system_tests::process_fixtures`,
//! a failpoint from `PROCESS_FAILPOINT`, settings from the environment (DATABASE_URL, WORKER_ID,
//! LEASE_MS, HEARTBEAT_MS, and METRICS_ADDR for /readyz, which follows the worker's claims).
//! SIGTERM stops it at a safe point.

use processes::{Worker, WorkerConfig};
use std::time::Duration;
use system_tests::process_fixtures::{self, Failpoint};

fn ms(name: &str, default: u64) -> Duration {
    Duration::from_millis(
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    plumbing::telemetry::init_logging();
    let url = std::env::var("DATABASE_URL")?;
    let worker =
        std::env::var("WORKER_ID").unwrap_or_else(|_| format!("worker-{}", std::process::id()));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await?;
    let fp = Failpoint::from_env(&worker);
    let registry = process_fixtures::registry(&pool, &fp);
    let mut config = WorkerConfig::new(pool, shared::schema::Schema::default(), worker);
    config.lease = ms("LEASE_MS", 2000);
    config.heartbeat = ms("HEARTBEAT_MS", config.lease.as_millis() as u64 / 4);
    config.poll_interval = Duration::from_millis(100);
    config.concurrency = 8;
    config.shutdown_grace = Duration::from_secs(5);
    let shutdown = plumbing::shutdown::on_signal();
    if let Ok(addr) = std::env::var("METRICS_ADDR") {
        let readiness = plumbing::telemetry::Readiness::without_rabbitmq();
        plumbing::telemetry::serve_ops(addr.parse()?, readiness.clone(), shutdown.clone()).await?;
        config.on_database = Some(processes::DatabaseHook(std::sync::Arc::new(move |up| {
            readiness.set_postgres(up)
        })));
    }
    Worker::run(config, registry, shutdown).await?;
    Ok(())
}
