//! What the outbox binaries (relay, consumer, the example application) share, and a producer
//! service does not need: a producer depends on `shared` alone.
//!
//! A short tour. Always there (light: sqlx, tokio, tracing):
//! - [`db`]: connecting to PostgreSQL with bounded waits (directly or through a transaction-pooling
//!   PgBouncer, with a direct URL for what needs a session), and migrating at start (safe with many instances).
//! - [`listen`]: the one LISTEN/wake-up loop (reconnects with [`backoff`]), used by the relay and
//!   the process worker.
//! - [`periodic`]: the one loop that refreshes something every interval until stopped (the
//!   relay's and the process worker's gauges).
//! - [`backoff`]: exponential backoff with full jitter, shared by retries and reconnects.
//! - [`shutdown`]: SIGTERM/SIGINT as a cancellation token passed to every `run`.
//! - [`membership`]: instance ids and the fair share of partitions among live instances (relay
//!   partitions, ordered consumer partitions).
//! - [`error`]: an error with all its sources as one log field.
//!
//! Feature `amqp` (default; lapin):
//! - [`amqp`]: connecting to RabbitMQ with heartbeats and timeouts, and the header mapping both sides use.
//! - [`amqp_tls`]: the CA (and optional client certificate) files for `amqps://` URLs.
//! - [`amqp_nodes`]: `AMQP_URL` as a comma-separated list of cluster nodes; connecting fails over
//!   to the next reachable node.
//! - [`broker_version`]: the RabbitMQ version of a connection (server properties), for features
//!   only some versions have.
//! - [`config`]: the connection settings (flags and env vars) every binary takes.
//!
//! Feature `telemetry` (default; axum, the Prometheus exporter, OpenTelemetry):
//! - [`telemetry`]: logging (human or JSON), optional OTLP span export, the Prometheus recorder, and the
//!   `/metrics`, `/healthz`, `/readyz` server.
//! - [`trace`]: a message's span as a child of its `traceparent`, for export.
//!
//! The `processes` crate takes plumbing without default features: a process worker embedded in
//! an application pulls neither lapin nor axum nor OpenTelemetry through it.

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "amqp")]
pub mod amqp_nodes;
#[cfg(feature = "amqp")]
pub mod amqp_tls;
pub mod backoff;
#[cfg(feature = "amqp")]
pub mod broker_version;
#[cfg(feature = "amqp")]
pub mod config;
pub mod db;
pub mod error;
pub mod listen;
pub mod membership;
pub mod periodic;
pub mod shutdown;
#[cfg(feature = "telemetry")]
pub mod telemetry;
#[cfg(feature = "telemetry")]
pub mod trace;

pub use tokio_util::sync::CancellationToken;
