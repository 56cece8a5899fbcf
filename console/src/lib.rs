//! The operations console: one process serving a JSON API (bearer tokens), a server-rendered web
//! page (session cookie, CSRF tokens) and `/metrics`, `/healthz`, `/readyz`, on the product schema.
//! The `console` binary's other subcommands are clients of the API, so the page, the API and the
//! CLI obey the same rules.
//!
//! A short tour:
//! - [`roles`]: roles (viewer < operator < approver < admin), actions and the matrix [`roles::allowed`].
//! - [`users`]: users and their hashed tokens; [`sessions`]: web sessions, cookies, the login limiter.
//! - [`actions`]: how every action runs (role check, effect and audit in one transaction, 409 on a
//!   stale version); [`commands`]: the actions themselves.
//! - [`keys`]: Idempotency-Keys through the `idempotency` crate's layer, scoped to the user.
//! - [`approvals`]: four eyes for sensitive actions; [`audit`]: the append-only audit log.
//! - [`outbox_dead`], [`dead_letters`]: dead outbox rows and consumer dead letters (via
//!   `consumer::dlq`); [`processes`]: processes and their actions, on the processes crate's
//!   `admin` module; [`ordered`]: ordered consumers' partitions and stuck aggregates, retried now
//!   or skipped with four eyes, on the consumer crate's `ordered::admin` module.
//! - [`api`], [`web`], [`openapi`]: the HTTP surface; [`client`]: the CLI's API client;
//!   [`headers`]: security headers on every answer; [`origin`]: cross-site POSTs refused.
//! - [`text`]: no control character in any text input, nor in an audit entry.
//! - [`redact`]: what never leaves the console; [`internal_events`]: metrics and logs.
//! - [`config`], [`state`], [`error`].

pub mod actions;
pub mod api;
pub mod approvals;
pub mod audit;
pub mod client;
pub mod commands;
pub mod config;
pub mod dead_letters;
pub mod error;
pub mod headers;
pub mod internal_events;
pub mod keys;
pub mod openapi;
pub mod ordered;
pub mod origin;
pub mod outbox_dead;
pub mod processes;
pub mod redact;
pub mod roles;
pub mod sessions;
pub mod state;
pub mod text;
pub mod users;
pub mod web;

pub use config::ServeConfig;
pub use error::ConsoleError;
pub use state::AppState;

use axum::Router;
use plumbing::telemetry::Readiness;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The whole router for `state`.
pub fn router(state: AppState, readiness: Arc<Readiness>) -> Router {
    Router::new()
        .merge(api::router(&state))
        .merge(web::router())
        .fallback(api::not_found)
        .with_state(state)
        .merge(plumbing::telemetry::ops_router(readiness))
        .layer(axum::middleware::from_fn(origin::same_origin_posts))
        .layer(axum::middleware::from_fn(headers::security_headers))
}

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
            cookie_secure: config.cookie_secure,
            audit_retention_days: config.audit_retention_days,
            ordered_gap_after: Duration::from_secs(config.ordered_gap_seconds),
        }),
        processes: processes::Admin::new(config.db.schema.clone()),
        idempotency: keys::store(pool.clone(), config.db.schema.clone()),
        limiter: Arc::new(sessions::LoginLimiter::new(
            config.login_attempts_per_minute.max(1),
            Duration::from_secs(60),
        )),
    };
    approvals::refresh_pending_gauge(&state).await;
    keys::purge(state.idempotency.clone(), shutdown.clone());
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
    let app = router(state, readiness);
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
