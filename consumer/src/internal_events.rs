//! Every metric the consumer emits, in one place, with fixed label sets.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `consumer_messages_total` | counter | `consumer`, `outcome` = processed, duplicate, retried, dead_lettered, ignored, discarded, held (ordered: waits for its turn), stale (ordered: at or below the applied position) |
//! | `consumer_dead_letters_total` | counter | `consumer`, `kind` = undecodable, unknown_event_type, permanent, exhausted |
//! | `consumer_deliveries_rejected_total` | counter | `consumer`, `reason` = not_utf8, malformed_headers, too_deep, headers_too_large (dead-lettered as undecodable), copy_too_large (rejected without requeue: its copy cannot fit a frame) |
//! | `consumer_handler_duration_seconds` | histogram | `consumer` (per handler call; a batch call counts once) |
//! | `consumer_end_to_end_latency_seconds` | histogram | `consumer` (outbox `created_at` to commit) |
//! | `consumer_batch_size` | histogram | `consumer` |
//! | `consumer_batch_duration_seconds` | histogram | `consumer` (first delivery of a batch to its ack) |
//! | `consumer_database_failures_total` | counter | `consumer` (batches rolled back by an infrastructure error) |
//! | `consumer_reconnects_total` | counter | `consumer` |
//! | `consumer_dedup_rows_deleted_total` | counter | `consumer` |
//! | `consumer_redeliveries_total` | counter | `consumer` (deliveries flagged `redelivered` or with an `x-delivery-count` above 0) |
//! | `consumer_ordered_partitions` | gauge | `consumer` (ordered mode: partition queues this instance consumes) |
//! | `consumer_ordered_parked_aggregates` | gauge | `consumer` (ordered mode: aggregates parked for an operator) |
//! | `consumer_ordered_gap_waits` | gauge | `consumer` (ordered mode: aggregates waiting for a missing message longer than the gap timeout) |
//! | `consumer_ordered_held_messages` | gauge | `consumer` (ordered mode: messages stored to wait for their turn) |
//! | `consumer_deliveries_returned_total` | counter | `consumer` (buffered, never started, returned with `basic.nack` on a graceful stop) |
//!
//! The same counts are kept in [`Stats`], which embedding code and tests read without a recorder.

use crate::message::DeadLetterKind;
use crate::screen::Reason;
use metrics::{Counter, Histogram};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub const MESSAGES_TOTAL: &str = "consumer_messages_total";
pub const DEAD_LETTERS_TOTAL: &str = "consumer_dead_letters_total";
pub const DELIVERIES_REJECTED: &str = "consumer_deliveries_rejected_total";
pub const HANDLER_DURATION: &str = "consumer_handler_duration_seconds";
pub const END_TO_END_LATENCY: &str = "consumer_end_to_end_latency_seconds";
pub const BATCH_SIZE: &str = "consumer_batch_size";
pub const BATCH_DURATION: &str = "consumer_batch_duration_seconds";
pub const DATABASE_FAILURES: &str = "consumer_database_failures_total";
pub const RECONNECTS: &str = "consumer_reconnects_total";
pub const DEDUP_ROWS_DELETED: &str = "consumer_dedup_rows_deleted_total";
pub const REDELIVERIES: &str = "consumer_redeliveries_total";
pub const DELIVERIES_RETURNED: &str = "consumer_deliveries_returned_total";
pub const PAUSED_WORKERS: &str = "consumer_paused_workers";
pub const DEPENDENCY_WAITS: &str = "consumer_dependency_waits_total";
pub const ORDERED_PARTITIONS: &str = "consumer_ordered_partitions";
pub const ORDERED_PARKED: &str = "consumer_ordered_parked_aggregates";
pub const ORDERED_GAPS: &str = "consumer_ordered_gap_waits";
pub const ORDERED_HELD: &str = "consumer_ordered_held_messages";

/// Ordered mode: partition queues this instance consumes now.
pub fn owned_partitions(consumer: &str, n: usize) {
    metrics::gauge!(ORDERED_PARTITIONS, "consumer" => consumer.to_string()).set(n as f64);
}

/// Ordered mode, the whole consumer (every instance reports the same): parked aggregates,
/// aggregates waiting for a missing message longer than the gap timeout, held messages.
pub fn ordered_state(consumer: &str, parked: i64, gaps: i64, held: i64) {
    let c = consumer.to_string();
    metrics::gauge!(ORDERED_PARKED, "consumer" => c.clone()).set(parked as f64);
    metrics::gauge!(ORDERED_GAPS, "consumer" => c.clone()).set(gaps as f64);
    metrics::gauge!(ORDERED_HELD, "consumer" => c).set(held as f64);
}

/// What happened to a delivery (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The handler's effect committed.
    Processed,
    /// Already processed by this consumer: skipped, acknowledged.
    Duplicate,
    /// Transient failure: a copy waits in a retry queue.
    Retried,
    /// Sent to the dead-letter queue.
    DeadLettered,
    /// No handler and not strict: acknowledged without effect.
    Ignored,
    /// Its copy could not be published (too large for a frame): rejected without requeue.
    Discarded,
    /// Ordered mode: stored in `consumer_held` to wait for its turn (a gap, or a failing or
    /// parked head before it), acknowledged.
    Held,
    /// Ordered mode: at or below its aggregate's applied position (a copy, or a message older
    /// than one applied): never applied, acknowledged, reported.
    Stale,
    /// A remote its handler needs is unavailable: a copy waits in a retry queue, no attempt
    /// spent.
    Waited,
    /// A fair share's sorting worker moved it to its key's lane (see `crate::fair`).
    Sorted,
}

impl Outcome {
    pub const ALL: [Outcome; 10] = [
        Self::Processed,
        Self::Duplicate,
        Self::Retried,
        Self::DeadLettered,
        Self::Ignored,
        Self::Discarded,
        Self::Held,
        Self::Stale,
        Self::Waited,
        Self::Sorted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Retried => "retried",
            Self::DeadLettered => "dead_lettered",
            Self::Ignored => "ignored",
            Self::Discarded => "discarded",
            Self::Held => "held",
            Self::Stale => "stale",
            Self::Waited => "waited",
            Self::Sorted => "sorted",
        }
    }
}

/// In-process counters mirroring the metrics (cheap to read, no recorder needed).
#[derive(Debug, Default)]
pub struct Stats {
    processed: AtomicU64,
    duplicate: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    ignored: AtomicU64,
    database_failures: AtomicU64,
    reconnects: AtomicU64,
    batches: AtomicU64,
    rejected: AtomicU64,
    discarded: AtomicU64,
    returned: AtomicU64,
    redelivered: AtomicU64,
    held: AtomicU64,
    stale: AtomicU64,
    waited: AtomicU64,
    sorted: AtomicU64,
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub processed: u64,
    pub duplicate: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub ignored: u64,
    pub database_failures: u64,
    pub reconnects: u64,
    pub batches: u64,
    /// Deliveries refused before decoding (any [`Reason`]).
    pub rejected: u64,
    /// Rejected without requeue because even their copy could not fit a frame.
    pub discarded: u64,
    /// Buffered but never started when a graceful stop returned them (`basic.nack`, requeue).
    pub returned: u64,
    /// Deliveries the broker had delivered before (redelivered flag or `x-delivery-count`).
    pub redelivered: u64,
    /// Ordered mode: deliveries stored to wait for their turn.
    pub held: u64,
    /// Ordered mode: deliveries at or below their aggregate's position (never applied).
    pub stale: u64,
    /// Deliveries that wait in a retry queue for an unavailable remote (no attempt spent).
    pub waited: u64,
    pub sorted: u64,
}

impl StatsSnapshot {
    /// Deliveries settled for good (everything but retries, which come back).
    pub fn settled(&self) -> u64 {
        self.processed
            + self.duplicate
            + self.dead_lettered
            + self.ignored
            + self.discarded
            + self.held
            + self.stale
    }
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            processed: l(&self.processed),
            duplicate: l(&self.duplicate),
            retried: l(&self.retried),
            dead_lettered: l(&self.dead_lettered),
            ignored: l(&self.ignored),
            database_failures: l(&self.database_failures),
            reconnects: l(&self.reconnects),
            batches: l(&self.batches),
            rejected: l(&self.rejected),
            discarded: l(&self.discarded),
            returned: l(&self.returned),
            redelivered: l(&self.redelivered),
            held: l(&self.held),
            stale: l(&self.stale),
            waited: l(&self.waited),
            sorted: l(&self.sorted),
        }
    }

    fn counter(&self, outcome: Outcome) -> &AtomicU64 {
        match outcome {
            Outcome::Processed => &self.processed,
            Outcome::Duplicate => &self.duplicate,
            Outcome::Retried => &self.retried,
            Outcome::DeadLettered => &self.dead_lettered,
            Outcome::Ignored => &self.ignored,
            Outcome::Discarded => &self.discarded,
            Outcome::Held => &self.held,
            Outcome::Stale => &self.stale,
            Outcome::Waited => &self.waited,
            Outcome::Sorted => &self.sorted,
        }
    }
}

/// Metric handles for one consumer, registered once (after the recorder is installed).
#[derive(Clone)]
pub struct Events {
    consumer: String,
    stats: Arc<Stats>,
    outcomes: [Counter; 10],
    dead_letter_kinds: [Counter; 4],
    rejected: [Counter; 5],
    handler_duration: Histogram,
    end_to_end: Histogram,
    batch_size: Histogram,
    batch_duration: Histogram,
    database_failures: Counter,
    reconnects: Counter,
    dedup_rows_deleted: Counter,
    returned: Counter,
    redeliveries: Counter,
}

impl Events {
    pub fn new(consumer: &str, stats: Arc<Stats>) -> Self {
        describe();
        let c = consumer.to_string();
        Self {
            consumer: c.clone(),
            stats,
            outcomes: Outcome::ALL
                .map(|o| metrics::counter!(MESSAGES_TOTAL, "consumer" => c.clone(), "outcome" => o.as_str())),
            dead_letter_kinds: DeadLetterKind::ALL
                .map(|k| metrics::counter!(DEAD_LETTERS_TOTAL, "consumer" => c.clone(), "kind" => k.as_str())),
            rejected: Reason::ALL
                .map(|r| metrics::counter!(DELIVERIES_REJECTED, "consumer" => c.clone(), "reason" => r.as_str())),
            handler_duration: metrics::histogram!(HANDLER_DURATION, "consumer" => c.clone()),
            end_to_end: metrics::histogram!(END_TO_END_LATENCY, "consumer" => c.clone()),
            batch_size: metrics::histogram!(BATCH_SIZE, "consumer" => c.clone()),
            batch_duration: metrics::histogram!(BATCH_DURATION, "consumer" => c.clone()),
            database_failures: metrics::counter!(DATABASE_FAILURES, "consumer" => c.clone()),
            reconnects: metrics::counter!(RECONNECTS, "consumer" => c.clone()),
            dedup_rows_deleted: metrics::counter!(DEDUP_ROWS_DELETED, "consumer" => c.clone()),
            returned: metrics::counter!(DELIVERIES_RETURNED, "consumer" => c.clone()),
            redeliveries: metrics::counter!(REDELIVERIES, "consumer" => c),
        }
    }

    /// `count` deliveries ended with `outcome`.
    pub fn messages(&self, outcome: Outcome, count: u64) {
        if count == 0 {
            return;
        }
        self.outcomes[Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0)]
            .increment(count);
        self.stats
            .counter(outcome)
            .fetch_add(count, Ordering::Relaxed);
    }

    /// One message was dead-lettered for `kind` (counted in addition to its outcome).
    pub fn dead_letter(&self, kind: DeadLetterKind) {
        self.dead_letter_kinds[DeadLetterKind::ALL
            .iter()
            .position(|k| *k == kind)
            .unwrap_or(0)]
        .increment(1);
    }

    /// A delivery was refused for `reason` (dead-lettered, or for
    /// [`Reason::CopyTooLarge`] rejected without requeue).
    pub fn rejected(&self, reason: Reason) {
        self.rejected[Reason::ALL.iter().position(|r| *r == reason).unwrap_or(0)].increment(1);
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// A handler call took `d` (whatever its result).
    pub fn handler_finished(&self, d: Duration) {
        self.handler_duration.record(d.as_secs_f64());
    }

    /// An effect committed `latency` after its outbox row was created.
    pub fn committed(&self, latency: Duration) {
        self.end_to_end.record(latency.as_secs_f64());
    }

    /// A batch was settled (acknowledged).
    pub fn batch(&self, size: usize, d: Duration) {
        self.batch_size.record(size as f64);
        self.batch_duration.record(d.as_secs_f64());
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
    }

    /// A batch transaction failed for an infrastructure reason and will be retried.
    pub fn database_failure(&self) {
        self.database_failures.increment(1);
        self.stats.database_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// The RabbitMQ session ended; reconnecting.
    pub fn reconnect(&self) {
        self.reconnects.increment(1);
        self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// A graceful stop returned `n` deliveries that were buffered but never started.
    pub fn returned(&self, n: u64) {
        self.returned.increment(n);
        self.stats.returned.fetch_add(n, Ordering::Relaxed);
    }

    /// A delivery the broker had delivered before arrived.
    pub fn redelivered(&self) {
        self.redeliveries.increment(1);
        self.stats.redelivered.fetch_add(1, Ordering::Relaxed);
    }

    /// A worker stopped (`true`) or resumed (`false`) taking deliveries because every handler's
    /// dependency (`held`, their names) held calls back.
    pub fn paused(&self, held: &str, paused: bool) {
        let g = metrics::gauge!(PAUSED_WORKERS, "consumer" => self.consumer.clone(), "dependencies" => held.to_string());
        if paused {
            g.increment(1.0)
        } else {
            g.decrement(1.0)
        }
    }

    /// A message waits for `dependency` (its circuit or limits kept the call back, or the remote
    /// answered "unavailable"): no attempt spent.
    pub fn dependency_wait(&self, dependency: &str) {
        metrics::counter!(DEPENDENCY_WAITS, "consumer" => self.consumer.clone(), "dependency" => dependency.to_string())
            .increment(1);
    }

    /// The retention sweep deleted `n` deduplication rows.
    pub fn dedup_rows_deleted(&self, n: u64) {
        self.dedup_rows_deleted.increment(n);
    }
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(MESSAGES_TOTAL, "Deliveries by how they ended");
    describe_counter!(
        DEAD_LETTERS_TOTAL,
        "Messages sent to the dead-letter queue, by reason"
    );
    describe_counter!(
        DELIVERIES_REJECTED,
        "Deliveries refused before decoding (unparsable, too deep, too large), by reason"
    );
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "Handler call run time (a batch call counts once)"
    );
    describe_histogram!(
        END_TO_END_LATENCY,
        Unit::Seconds,
        "Outbox insert to consumer commit"
    );
    describe_histogram!(BATCH_SIZE, "Deliveries per batch transaction");
    describe_counter!(
        DEPENDENCY_WAITS,
        "Messages that waited for a dependency (circuit or limits, or an unavailable answer), no attempt spent"
    );
    metrics::describe_gauge!(
        PAUSED_WORKERS,
        "Workers taking no deliveries because every handler's dependency holds calls back (the backlog stays in the queue)"
    );
    describe_histogram!(
        BATCH_DURATION,
        Unit::Seconds,
        "First delivery of a batch to its acknowledgement"
    );
    describe_counter!(
        DATABASE_FAILURES,
        "Batch transactions rolled back by a database infrastructure error"
    );
    describe_counter!(
        RECONNECTS,
        "RabbitMQ sessions that ended and were re-established"
    );
    describe_counter!(
        DELIVERIES_RETURNED,
        "Deliveries buffered but never started, returned to the queue (basic.nack) on a graceful stop"
    );
    describe_counter!(
        REDELIVERIES,
        "Deliveries the broker had delivered before (redelivered flag or x-delivery-count above 0)"
    );
    describe_counter!(
        DEDUP_ROWS_DELETED,
        "processed_messages rows deleted by the retention sweep"
    );
}
