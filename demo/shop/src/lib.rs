//! The example application beside the product (not part of it): `producer`, an HTTP API that
//! places orders and requests payments. Each successful POST writes its business rows, its outbox
//! event and the final state of its idempotency record in one PostgreSQL transaction; the relay
//! publishes the events. Its tables live in schema `demo`, the product's in its own.
//!
//! A short tour:
//! - [`http`]: the router ([`app`]), middleware, fallbacks and the server ([`start`], [`run`]).
//! - [`orders`], [`payments`]: the handlers, request and response types, and each route's
//!   Idempotency-Key layer (the `idempotency` crate: reservation before the effect, the effect's
//!   transaction, fenced completion, release on failure, replay, expiry and purge).
//! - [`idempotent_post`]: what both POST routes share: the layer over a validated body, and the
//!   end of the effect (the event into the outbox, the fault hook before the commit).
//! - [`payment_process`]: the `payment` process definition (reserve the order, charge at the
//!   provider, record the capture; release and a sensitive refund as compensations) that
//!   `POST /payments` starts in its transaction.
//! - [`worker`]: `producer worker`, which runs payment processes against the provider.
//! - [`reconciliation`]: the regular comparison of the provider's charges with the payments,
//!   each mismatch a case for manual review (run by `producer worker`).
//! - [`provider_webhooks`]: `POST /webhooks/provider`, the provider's signed events recorded once
//!   per payment (the `idempotency` crate's webhook receiver).
//! - [`ledger`]: the example consumer handler (`payment.captured` moves ledger balances).
//! - [`timeline`]: the example consumer that records the order it applies events in
//!   (`producer timeline`, `demo.timeline`), and [`timeline::violations`] over it.
//! - [`replay_marker`]: the `"replayed": true` the demo's replays carry in their body.
//! - [`validation`]: strict parsing of request bodies (field errors as `{"errors": [...]}`).
//! - [`auth`]: bearer API keys mapped to tenants, stored hashed; key creation.
//! - [`error`]: [`ApiError`] and the only error body shapes.
//! - [`trace_context`]: the W3C `traceparent` put on every event.
//! - [`internal_events`]: the HTTP request metric (the `api_idempotency_*` metrics are the
//!   idempotency layer's).
//! - [`openapi`]: the OpenAPI document served at `/openapi.json`.
//! - [`config`], [`state`]: configuration, settings, the shared state with its idempotency store
//!   and injectable clock.
//! - [`fault`]: the fault-injection hook tests use and the operations it is called for.
//! - [`migrate`]: the example's migrations (schema `demo`, history `demo._migrations`), applied
//!   after the product's by [`connect_and_migrate`] / [`connect_and_migrate_to`] (directly, or
//!   through a transaction pooler with a direct URL for the migrations).
//!
//! **Tables** (schema `demo`, the example's, not the product's): `orders`, `order_items`,
//! `payments`, `api_keys`, `ledger_balances`, `payment_events`, `reconciliation_cases`, `timeline`.

pub mod auth;
pub mod config;
pub mod error;
pub mod fault;
pub mod http;
pub mod idempotent_post;
pub mod internal_events;
pub mod ledger;
pub mod migrate;
pub mod notifier;
pub mod openapi;
pub mod orders;
pub mod payment_process;
pub mod payments;
pub mod provider_webhooks;
pub mod reconciliation;
pub mod replay_marker;
pub mod state;
pub mod timeline;
pub mod trace_context;
pub mod validation;
pub mod worker;

pub use config::{Config, Settings};
pub use error::ApiError;
pub use fault::{FaultHook, InjectedFault, Operation, Stage};
pub use http::{Server, app, start};
pub use state::{AppState, Clock, ManualClock};

use shared::schema::Schema;
use std::net::SocketAddr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why the producer could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ProducerError {
    #[error(transparent)]
    Database(#[from] plumbing::db::DbError),
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP server failed")]
    Serve(#[source] std::io::Error),
    #[error("HTTP server task failed")]
    Join(#[source] tokio::task::JoinError),
}

/// Connects (retrying until the deadline) and applies the product's migrations, then the example
/// application's (schema `demo`).
pub async fn connect_and_migrate(
    config: &Config,
    max_connections: u32,
    app_name: &str,
) -> Result<sqlx::PgPool, plumbing::db::DbError> {
    connect_and_migrate_to(
        plumbing::db::Target::direct(&config.database_url),
        max_connections,
        app_name,
        &config.schema,
        Duration::from_secs(config.db_connect_deadline_secs),
    )
    .await
}

/// [`connect_and_migrate`] for a [`plumbing::db::Target`]: the pool goes through its pooler, the
/// migrations run over its session URL (not at all behind a transaction pooler without a direct
/// URL).
pub async fn connect_and_migrate_to(
    target: plumbing::db::Target<'_>,
    max_connections: u32,
    app_name: &str,
    schema: &Schema,
    deadline: Duration,
) -> Result<sqlx::PgPool, plumbing::db::DbError> {
    let schema = schema.clone();
    plumbing::db::connect_and_migrate_with(
        target,
        max_connections,
        app_name,
        deadline,
        move |pool| {
            let schema = schema.clone();
            Box::pin(async move { migrate::run(&pool, &schema).await })
        },
    )
    .await
}

/// Connects (retrying until the deadline), applies the migrations, and serves until `shutdown`.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), ProducerError> {
    let pool = connect_and_migrate(&config, config.db_max_connections, "producer").await?;
    let state = AppState::new(pool.clone(), config.settings());
    let server = start(state, config.listen_addr, shutdown).await?;
    tracing::info!(addr = %server.local_addr(), "producer API listening");
    let result = server.wait().await;
    pool.close().await;
    result
}
