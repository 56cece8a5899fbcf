//! What every component of the outbox system shares.
//!
//! A short tour:
//! - [`envelope`]: the message as producers write it ([`NewMessage`]) and as consumers read it ([`Envelope`]).
//! - [`outbox`]: the Rust producer API: enqueue one or many messages through the caller's transaction.
//! - [`publishable`]: the rules a message must meet to be publishable (AMQP limits, reserved headers),
//!   the same the outbox table's CHECK constraints and the relay's encoder enforce.
//! - [`display`]: escaping what CLIs print, so no value can forge operator output.
//! - [`schema`]: the product's own PostgreSQL schema (`outbox` by default), validated and quoted.
//! - [`migrate`]: the product's migrations, applied in that schema with their own history table.
//! - [`db`]: connecting to PostgreSQL with bounded waits, and migrating at start (safe with many instances).
//! - [`amqp`]: connecting to RabbitMQ with heartbeats and timeouts, and the header mapping both sides use.
//! - [`telemetry`]: logging (human or JSON), optional OTLP span export, the Prometheus recorder, and the
//!   `/metrics`, `/healthz`, `/readyz` server.
//! - [`trace`]: W3C `traceparent` parsing and continuing a message's trace.
//! - [`shutdown`]: SIGTERM/SIGINT as a cancellation token passed to every `run`.
//! - [`backoff`]: exponential backoff with full jitter, shared by retries and reconnects.
//! - [`config`]: the connection settings (flags and env vars) every binary takes.

pub mod amqp;
pub mod backoff;
pub mod config;
pub mod db;
pub mod display;
pub mod envelope;
pub mod migrate;
pub mod outbox;
pub mod publishable;
pub mod schema;
pub mod shutdown;
pub mod telemetry;
pub mod trace;

pub use envelope::{Envelope, NewMessage};
pub use tokio_util::sync::CancellationToken;
