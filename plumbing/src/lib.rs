//! What the outbox binaries (relay, consumer, the example application) share, and a producer
//! service does not need: a producer depends on `shared` alone.
//!
//! A short tour:
//! - [`db`]: connecting to PostgreSQL with bounded waits (directly or through a transaction-pooling
//!   PgBouncer, with a direct URL for what needs a session), and migrating at start (safe with many instances).
//! - [`amqp`]: connecting to RabbitMQ with heartbeats and timeouts, and the header mapping both sides use.
//! - [`amqp_tls`]: the CA (and optional client certificate) files for `amqps://` URLs.
//! - [`amqp_nodes`]: `AMQP_URL` as a comma-separated list of cluster nodes; connecting fails over
//!   to the next reachable node.
//! - [`telemetry`]: logging (human or JSON), optional OTLP span export, the Prometheus recorder, and the
//!   `/metrics`, `/healthz`, `/readyz` server.
//! - [`trace`]: a message's span as a child of its `traceparent`, for export.
//! - [`shutdown`]: SIGTERM/SIGINT as a cancellation token passed to every `run`.
//! - [`broker_version`]: the RabbitMQ version of a connection (server properties), for features
//!   only some versions have.
//! - [`backoff`]: exponential backoff with full jitter, shared by retries and reconnects.
//! - [`config`]: the connection settings (flags and env vars) every binary takes.
//! - [`membership`]: instance ids and the fair share of partitions among live instances (relay
//!   partitions, ordered consumer partitions).

pub mod amqp;
pub mod amqp_nodes;
pub mod amqp_tls;
pub mod backoff;
pub mod broker_version;
pub mod config;
pub mod db;
pub mod membership;
pub mod shutdown;
pub mod telemetry;
pub mod trace;

pub use tokio_util::sync::CancellationToken;
