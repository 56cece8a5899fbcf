//! Consumes outbox events from RabbitMQ and applies each event's effect once per consumer.
//!
//! You write a [`Handler`] (it gets the open transaction and the decoded [`Envelope`]) and
//! register it per event type in [`Handlers`]; the runtime does everything else: topology,
//! batching, deduplication in the effect's transaction, commit-then-ack, retries with delay,
//! dead letters, reconnects, retention, metrics and graceful shutdown.
//!
//! A short tour:
//! - [`handler`]: the [`Handler`] trait, [`HandlerError`] (transient, permanent, database) and the
//!   [`Handlers`] registry (AMQP topic patterns, optional catch-all).
//! - [`supervisor`]: [`Consumer`] / [`run`]: connect, declare, run the workers of a session,
//!   reconnect with backoff; readiness and the database watch.
//! - `links`: a session's two connections, one consuming and acknowledging, one publishing the
//!   copies (so a resource alarm, which blocks publishing connections, never stops the acks).
//! - `context`: what the supervisor and its workers share, and the bound on broker round trips.
//! - [`worker`]: one worker's consume loop: buffered deliveries into batches, each delivery's work
//!   decided before the transaction, retries while the database fails, the copies published with
//!   confirms, then one multi-ack.
//! - [`batch`]: a batch's items, the batch transaction (dedup insert, handlers with savepoints on
//!   failure, commit) and each message's fate.
//! - [`broker_headers`]: the headers RabbitMQ owns (`x-death`, `x-delivery-count`...), which
//!   copies and replays leave behind.
//! - [`copies`]: what a retry copy or dead letter of a delivery is, made to fit one frame (the
//!   largest original headers cut, the reason kept).
//! - [`dedup`]: the `processed_messages` statements and which database errors are infrastructure.
//! - [`topology`]: the queue, retry queues, dead-letter exchange and queue a consumer declares.
//! - [`screen`]: what a delivery must be before it is decoded (UTF-8 text, parsed headers of
//!   bounded depth and size); what is not is dead-lettered with its reason.
//! - [`message`]: AMQP delivery to [`Envelope`], and the headers retries and dead letters carry.
//! - [`dlq`]: `consumer dlq list` and `consumer dlq replay` (the `consumer` binary is this CLI; the
//!   example application's `producer ledger` runs a consumer with a handler).
//! - [`ordered`]: ordered mode (`Config::ordered`): per-aggregate order across instances,
//!   partition queues and leases; its own tables (`consumer_positions`, `consumer_held`,
//!   `consumer_partitions`, ...).
//! - `pause`: a worker takes no deliveries while every handler's dependency holds calls back
//!   (the backlog stays in the queue), then one message at a time for the probe.
//! - [`fair`]: weighted fair share by a key header: the queue sorted into lanes worked side by
//!   side, so one tenant's burst holds its own lane only.
//! - [`retention`]: the bounded, single-instance sweep of old dedup rows.
//! - [`internal_events`]: every metric, with fixed label sets, and the in-process [`Stats`].
//! - [`config`]: [`Config`] and the command-line [`config::Settings`].
//! - [`error`]: the error types.
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> Result<(), consumer::ConsumerError> {
//! # #[derive(Clone)] struct MyHandler;
//! # impl consumer::Handler for MyHandler {
//! #     async fn handle(&self, _: &mut sqlx::PgConnection, _: &consumer::Envelope) -> Result<(), consumer::HandlerError> { Ok(()) }
//! # }
//! let config = consumer::Config::new("billing", "amqp://guest:guest@127.0.0.1:5672/%2f", "outbox.events");
//! let handlers = consumer::Handlers::new().on("invoice.*", MyHandler);
//! let shutdown = plumbing::shutdown::on_signal();
//! consumer::run(config, pool, handlers, shutdown).await
//! # }
//! ```
//!
//! **Tables.** The consumer owns `processed_messages` (dedup), and for ordered mode
//! `consumer_groups`, `consumer_instances`, `consumer_partitions`, `consumer_positions` and
//! `consumer_held` ([`ordered`]); the console acts on them through `ordered::admin`.

pub mod batch;
pub mod broker_headers;
pub mod config;
mod context;
pub mod copies;
pub mod dedup;
pub mod dlq;
pub mod error;
pub mod fair;
pub mod handler;
#[cfg(test)]
mod header_strategies;
pub mod internal_events;
mod links;
pub mod message;
pub mod ordered;
mod pause;
pub mod retention;
pub mod screen;
pub mod supervisor;
pub mod topology;
pub mod worker;

pub use config::Config;
pub use error::{ConfigError, ConsumerError, DlqError, SessionError};
pub use handler::{BoxError, Handler, HandlerError, Handlers};
pub use internal_events::{Stats, StatsSnapshot};
pub use shared::Envelope;
pub use supervisor::{Consumer, run};
pub use topology::Topology;
