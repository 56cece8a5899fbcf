//! Ordered mode: each aggregate's messages are applied in `aggregate_seq` order, across any
//! number of instances, and a failing message holds back only its own aggregate.
//!
//! Order rests on RabbitMQ routing and on PostgreSQL, nothing else:
//! - [`topology`]: the consumer's headers exchange splits its traffic over `N` partition queues
//!   by the relay's `aggregate_partition` header: one aggregate, one queue, in publish order.
//! - [`group`]: each partition queue is consumed by one instance at a time (leases shared evenly,
//!   ±1, like the relay's), and every apply transaction checks its lease and epoch: a paused
//!   instance that lost its partition applies nothing after.
//! - [`decide`]: from an aggregate's position alone, what to apply now, hold or report stale.
//! - [`apply`]: the transaction: lock the positions, apply in order (consecutive messages of an
//!   aggregate in one handler call), hold what must wait, commit; the caller acks after.
//! - [`store`]: the statements on `consumer_positions` and `consumer_held`.
//! - `runner`: a session: heartbeat, a worker per partition held, rebalancing.
//! - [`admin`]: parked and gap-waiting aggregates for operators; retry, skip, dead-letter.
//!
//! Tables (migration 12), owned here: `consumer_groups`, `consumer_partitions`,
//! `consumer_instances`, `consumer_positions`, `consumer_held`.
//!
//! A message is acknowledged only once it is applied or durably held. Ordered mode deduplicates
//! by position (a message at or below its aggregate's applied number is never applied), so it
//! writes no `processed_messages` rows.

pub mod admin;
pub mod apply;
pub mod decide;
pub mod group;
pub(crate) mod runner;
pub mod store;
pub mod topology;

use std::time::Duration;

/// How often a partition worker looks for held messages whose turn came without a delivery (a
/// retry's time, an operator's release).
pub const SWEEP_INTERVAL: Duration = Duration::from_millis(500);
