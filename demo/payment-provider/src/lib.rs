//! A payment provider simulator for the example application: charges and refunds over HTTP, its
//! own state in PostgreSQL (schema `provider`), and faults injected on purpose (errors before the
//! charge, timeouts and connection resets after it, slowness, declines), so that the payment
//! process can be tested against every way a real provider fails. See docs/payment-provider.md.
//!
//! A short tour:
//! - [`api`]: the wire types (charges, refunds, the fault body), shared with the client.
//! - [`client`]: the typed client the payment process calls; its errors classify every outcome
//!   as declined, unavailable (nothing charged), outcome unknown or invalid.
//! - [`charges`]: `POST /charges` with Idempotency-Key, the lookups by id and by reference.
//! - [`refunds`]: `POST /refunds`.
//! - [`admin`]: `GET /admin/charges`, `GET`/`POST /admin/faults`, `GET`/`POST /admin/mode`,
//!   `GET /admin/events`.
//! - [`mode`]: sync or async confirmation.
//! - [`webhooks`]: async mode's later decision, its events, their signature and delivery.
//! - [`faults`]: the `mode:percent,...` syntax and the seeded draw per request.
//! - [`connection`]: hyper connections a handler can reset (TCP RST) for `reset_after_charge`.
//! - [`http`]: the router and the server; [`error`]: the `{"error": ...}` answers.
//! - [`migrate`]: the schema `provider` and its own history table `provider._migrations`.
//! - [`config`], [`state`], [`internal_events`] (every metric).
//!
//! **Tables** (schema `provider`): `charges`, `refunds` and `events` (the webhook deliveries).

pub mod admin;
pub mod api;
pub mod charges;
pub mod client;
pub mod config;
pub mod connection;
pub mod error;
pub mod faults;
pub mod http;
pub mod internal_events;
pub mod migrate;
pub mod mode;
pub mod notifications;
pub mod outage;
pub mod refunds;
pub mod state;
pub mod webhooks;

pub use config::Config;
pub use state::AppState;

use plumbing::telemetry::{ErrorChain, Readiness};
use std::net::SocketAddr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why the simulator could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error(transparent)]
    Database(#[from] plumbing::db::DbError),
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the HTTP server task failed")]
    Join(#[source] tokio::task::JoinError),
    #[error("PROVIDER_WEBHOOK_URL is set without PROVIDER_WEBHOOK_SECRET: events must be signed")]
    WebhookSecretMissing,
}

/// Connects (retrying until the configured deadline) and applies the simulator's migrations, on
/// plumbing's start-up rules (a migration that cannot succeed later fails at once).
pub async fn connect_and_migrate(config: &Config) -> Result<sqlx::PgPool, plumbing::db::DbError> {
    plumbing::db::connect_and_migrate_with(
        plumbing::db::Target::direct(&config.database_url),
        config.db_max_connections,
        "payment-provider",
        Duration::from_secs(config.db_connect_deadline_secs),
        |pool| Box::pin(async move { migrate::run(&pool).await }),
    )
    .await
}

/// Connects, migrates, and serves until `shutdown`.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), ProviderError> {
    if config.webhook_url.as_deref().is_some_and(|u| !u.is_empty())
        && config.webhook_secret.as_deref().is_none_or(str::is_empty)
    {
        return Err(ProviderError::WebhookSecretMissing);
    }
    let pool = tokio::select! {
        pool = connect_and_migrate(&config) => pool?,
        _ = shutdown.cancelled() => return Ok(()),
    };
    internal_events::describe();
    let readiness = Readiness::without_rabbitmq();
    readiness.set_postgres(true);
    let state = AppState::new(pool.clone(), &config, shutdown.clone());
    let decider = tokio::spawn(webhooks::decider::run(state.clone()));
    let deliverer = tokio::spawn(webhooks::delivery::run(state.clone()));
    let server = http::start(state, readiness, config.addr, shutdown)
        .await
        .map_err(|source| ProviderError::Bind {
            addr: config.addr,
            source,
        })?;
    internal_events::listening(
        server.local_addr(),
        &config.faults,
        config.idempotency,
        config.status_query,
        config.mode,
        config.webhook_url.as_deref(),
    );
    let result = server.wait().await.map_err(ProviderError::Join);
    // Both loops end at shutdown (a delivery in flight is bounded by PROVIDER_WEBHOOK_TIMEOUT).
    for task in [decider, deliverer] {
        if let Err(e) = task.await {
            tracing::warn!(error = %ErrorChain(&e), "a webhook task failed");
        }
    }
    pool.close().await;
    result
}
