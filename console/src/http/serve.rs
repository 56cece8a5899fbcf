//! Starting the console: connect and migrate, build the state, spawn its background tasks
//! (idempotency purge, readiness probe), bind and serve [`super::router`].

use crate::auth::{keys, sessions};
use crate::config::ServeConfig;
use crate::state::{self, AppState};
use crate::{actions, internal_events, redact, targets};
use plumbing::telemetry::Readiness;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why the console could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("database")]
    Db(#[from] plumbing::db::DbError),
    #[error("serving")]
    Io(#[from] std::io::Error),
    #[error("server task")]
    Join(#[from] tokio::task::JoinError),
}

/// A started console.
pub struct Running {
    /// The bound address (port 0 in the config gives a free one).
    pub addr: SocketAddr,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Connects, migrates, binds and serves until `shutdown`.
pub async fn start(
    config: ServeConfig,
    shutdown: CancellationToken,
) -> Result<Running, StartError> {
    redact::declare_secret_fields(&config.secret_fields);
    // Install the recorder before the first metric is registered.
    let _ = plumbing::telemetry::metrics_handle();
    internal_events::describe();
    let pool = plumbing::db::connect_and_migrate(
        &config.db.database_url,
        8,
        "console",
        &config.db.schema,
        Duration::from_secs(60),
    )
    .await?;
    let readiness = Readiness::without_rabbitmq();
    readiness.set_postgres(true);
    let state = AppState {
        pool: pool.clone(),
        schema: config.db.schema.clone(),
        settings: Arc::new(state::Settings {
            amqp_url: plumbing::amqp::with_defaults(&config.amqp_url),
            amqp_tls: config.amqp_tls.clone(),
            consumers: config.consumers.clone(),
            session_ttl: config.session_ttl(),
            session_idle: config.session_idle(),
            cookie_secure: config.cookie_secure,
            audit_retention_days: config.audit_retention_days,
            ordered_gap_after: Duration::from_secs(config.ordered_gap_seconds),
            look: config.look.clone(),
        }),
        processes: targets::processes::Admin::new(config.db.schema.clone()),
        idempotency: keys::store(pool.clone(), config.db.schema.clone()),
        limiter: Arc::new(sessions::LoginLimiter::new(
            config.login_attempts_per_minute.max(1),
            Duration::from_secs(60),
        )),
    };
    actions::approvals::refresh_pending_gauge(&state).await;
    keys::purge(state.idempotency.clone(), shutdown.clone());
    targets::samples::spawn(state.clone(), shutdown.clone());
    // Readiness follows the database.
    {
        let (pool, readiness, shutdown) = (pool.clone(), readiness.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                let up = tokio::time::timeout(
                    Duration::from_secs(5),
                    sqlx::query("SELECT 1").execute(&pool),
                )
                .await
                .is_ok_and(|r| r.is_ok());
                readiness.set_postgres(up);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        });
    }
    let app = super::router(state, readiness);
    let listener = tokio::net::TcpListener::bind(config.addr).await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, schema = %config.db.schema, "console listening");
    let task = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
    });
    Ok(Running { addr, task })
}

/// [`start`], then serve until `shutdown`.
pub async fn run(config: ServeConfig, shutdown: CancellationToken) -> Result<(), StartError> {
    let running = start(config, shutdown).await?;
    running.task.await??;
    Ok(())
}
