//! What a producer service needs to write outbox messages, and what every component agrees on
//! about a message. Deliberately light (sqlx, serde, uuid, chrono): the connections, telemetry
//! and AMQP plumbing of the binaries live in `plumbing`.
//!
//! A short tour:
//! - [`envelope`]: the message as producers write it ([`NewMessage`]) and as consumers read it ([`Envelope`]).
//! - [`outbox`]: the Rust producer API: enqueue one or many messages through the caller's transaction.
//! - [`publishable`]: the rules a message must meet to be publishable (AMQP limits, reserved headers),
//!   the same the outbox table's CHECK constraints and the relay's encoder enforce.
//! - [`schema`]: the product's own PostgreSQL schema (`outbox` by default), validated and quoted.
//! - [`migrate`]: the product's migrations, applied in that schema with their own history table;
//!   a service runs them from its own start-up code, next to its own.
//! - [`display`]: escaping what CLIs print, so no value can forge operator output.
//! - [`error_chain`]: an error with all its sources, as one log field.
//! - [`trace`]: W3C `traceparent` parsing.
//!
//! **Tables.** Every table of the product's schema is created by [`migrate`] (one history per
//! schema), and each has one owner, named in that crate's tour: the relay, the consumer, idempotency,
//! processes, the console. `shared` itself writes only producers' rows into `messages` (the outbox
//! contract; the `aggregate_sequences` trigger numbers them inside the producer's transaction).

pub mod display;
pub mod envelope;
pub mod error_chain;
pub mod migrate;
pub mod money;
pub mod outbox;
pub mod publishable;
pub mod schema;
pub mod trace;

pub use envelope::{Envelope, NewMessage};
