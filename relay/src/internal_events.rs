//! Every metric the relay emits, in one place, with fixed label sets.

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use std::time::Duration;

/// Why a publish did not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureReason {
    /// The broker nacked the message.
    Nack,
    /// The message was returned as unroutable (mandatory, no alternate exchange).
    Unroutable,
    /// No confirm within the confirm timeout.
    ConfirmTimeout,
    /// The connection or channel failed with the publish unconfirmed.
    Connection,
    /// The row can never be published as it is (a broken rule, too large for a frame or the
    /// payload limit, undecodable): dead at once.
    Unpublishable,
    /// The broker closed the channel because of this row (found by sending the rows in flight one
    /// at a time after such a close).
    BrokerRefused,
}

impl FailureReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Nack => "nack",
            FailureReason::Unroutable => "unroutable",
            FailureReason::ConfirmTimeout => "confirm_timeout",
            FailureReason::Connection => "connection",
            FailureReason::Unpublishable => "unpublishable",
            FailureReason::BrokerRefused => "broker_refused",
        }
    }
    /// Whether the failure is the message's own (counts toward max attempts) rather than the link's.
    pub fn charged_to_message(self) -> bool {
        matches!(
            self,
            FailureReason::Nack
                | FailureReason::Unroutable
                | FailureReason::Unpublishable
                | FailureReason::BrokerRefused
        )
    }
}

pub fn describe() {
    describe_gauge!(
        "outbox_pending_messages",
        "Outbox rows waiting to be published"
    );
    describe_gauge!(
        "outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest pending outbox row"
    );
    describe_gauge!(
        "outbox_dead_messages",
        "Outbox rows that exhausted their attempts"
    );
    describe_gauge!(
        "outbox_oldest_snapshot_age_seconds",
        Unit::Seconds,
        "Age of the oldest transaction holding a snapshot in the outbox's database (sessions, hot_standby_feedback, prepared transactions): nothing deleted or updated since it began can be cleaned up"
    );
    describe_gauge!(
        "outbox_oldest_xmin_age_transactions",
        "Transactions since the oldest xmin holding back cleanup (sessions and replication slots)"
    );
    describe_gauge!(
        "outbox_dead_tuples",
        "Dead tuples per table of the product's schema, partitions summed (pg_stat_user_tables)"
    );
    describe_gauge!(
        "relay_unrouted_messages",
        "Messages waiting in the alternate-exchange queue (no binding matched)"
    );
    describe_gauge!(
        "relay_owned_partitions",
        "Outbox partitions this relay holds a lease on"
    );
    describe_gauge!("relay_ready", "1 when connected to PostgreSQL and RabbitMQ");
    describe_gauge!(
        "relay_broker_blocked",
        "1 while RabbitMQ blocks this relay's connection (memory or disk alarm), or reads nothing of a batch for the confirm timeout: nothing is published"
    );
    describe_counter!(
        "relay_published_total",
        "Rows confirmed by the broker and marked published"
    );
    describe_counter!(
        "relay_publish_failures_total",
        "Publishes that did not count, by reason"
    );
    describe_counter!(
        "relay_dead_total",
        "Rows that became dead after max attempts"
    );
    describe_counter!(
        "relay_reconnects_total",
        "Reconnections to a dependency, by target"
    );
    describe_counter!(
        "relay_amqp_opened_total",
        "RabbitMQ connections and channels opened, by kind (a refused message costs a channel, never the connection)"
    );
    describe_histogram!(
        "relay_publish_latency_seconds",
        Unit::Seconds,
        "Outbox insert to broker confirm"
    );
    describe_histogram!("relay_batch_size", "Rows per claimed batch");
    describe_histogram!(
        "relay_claim_lag_seconds",
        Unit::Seconds,
        "Outbox insert to the claim that picked the row up"
    );
    describe_histogram!(
        "relay_confirm_duration_seconds",
        Unit::Seconds,
        "Publish sent to broker confirm"
    );
    describe_histogram!(
        "relay_db_duration_seconds",
        Unit::Seconds,
        "Run time of the relay's claim and mark statements, by op"
    );
}

pub fn published(count: usize) {
    counter!("relay_published_total").increment(count as u64);
}

pub fn publish_latency(latency: Duration) {
    histogram!("relay_publish_latency_seconds").record(latency.as_secs_f64());
}

pub fn publish_failed(reason: FailureReason, count: usize) {
    counter!("relay_publish_failures_total", "reason" => reason.as_str()).increment(count as u64);
}

pub fn rows_dead(count: usize) {
    counter!("relay_dead_total").increment(count as u64);
}

pub fn claim_lag(lag: Duration) {
    histogram!("relay_claim_lag_seconds").record(lag.as_secs_f64());
}

pub fn confirm_duration(d: Duration) {
    histogram!("relay_confirm_duration_seconds").record(d.as_secs_f64());
}

/// Which relay statement a [`db_duration`] belongs to.
#[derive(Debug, Clone, Copy)]
pub enum DbOp {
    Claim,
    Mark,
}

pub fn db_duration(op: DbOp, d: Duration) {
    let op = match op {
        DbOp::Claim => "claim",
        DbOp::Mark => "mark",
    };
    histogram!("relay_db_duration_seconds", "op" => op).record(d.as_secs_f64());
}

pub fn batch_claimed(size: usize) {
    histogram!("relay_batch_size").record(size as f64);
}

/// A connection or a channel to RabbitMQ was opened (`kind`: `connection` or `channel`).
pub fn amqp_opened(kind: &'static str) {
    counter!("relay_amqp_opened_total", "kind" => kind).increment(1);
}

pub fn reconnect(target: &'static str) {
    counter!("relay_reconnects_total", "target" => target).increment(1);
}

pub fn owned_partitions(n: usize) {
    gauge!("relay_owned_partitions").set(n as f64);
}

pub fn ready(ready: bool) {
    gauge!("relay_ready").set(if ready { 1.0 } else { 0.0 });
}

/// PostgreSQL or RabbitMQ (`None`: unchanged) became usable or not: updates `/readyz` and the gauge.
pub fn readiness(
    readiness: &plumbing::telemetry::Readiness,
    postgres: Option<bool>,
    rabbitmq: Option<bool>,
) {
    if let Some(p) = postgres {
        readiness.set_postgres(p);
    }
    if let Some(r) = rabbitmq {
        readiness.set_rabbitmq(r);
    }
    ready(readiness.ready());
}

/// RabbitMQ blocked (`connection.blocked`, or reading nothing) or unblocked the publishing
/// connection.
pub fn broker_blocked(blocked: bool) {
    gauge!("relay_broker_blocked").set(if blocked { 1.0 } else { 0.0 });
}

pub fn backlog(pending: i64, oldest_age: Duration, dead: i64) {
    gauge!("outbox_pending_messages").set(pending as f64);
    gauge!("outbox_oldest_pending_age_seconds").set(oldest_age.as_secs_f64());
    gauge!("outbox_dead_messages").set(dead as f64);
}

/// What holds back cleanup, and the dead tuples of the product's tables.
pub fn horizon(h: &crate::store::Horizon) {
    gauge!("outbox_oldest_snapshot_age_seconds").set(h.oldest_snapshot_age);
    gauge!("outbox_oldest_xmin_age_transactions").set(h.oldest_xmin_age as f64);
    for (table, n) in &h.dead_tuples {
        gauge!("outbox_dead_tuples", "table" => table.clone()).set(*n as f64);
    }
}

pub fn unrouted(count: u32) {
    gauge!("relay_unrouted_messages").set(f64::from(count));
}
