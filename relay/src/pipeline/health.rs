//! Whether PostgreSQL and RabbitMQ work for the pipeline, and when to try again after a failure.

use crate::internal_events;
use plumbing::telemetry::Readiness;
use std::time::Duration;
use tokio::time::Instant;

/// Nacks in a row (no ack between) after which the relay reconnects: after a cluster node died, a
/// channel can go on nacking although the queue has a new leader.
pub(super) const NACKS_BEFORE_RECONNECT: u32 = 5;

pub(super) struct Health<'a> {
    readiness: &'a Readiness,
    db_failures: u32,
    amqp_failures: u32,
    /// Nothing is claimed, marked or connected before this time.
    retry_at: Option<Instant>,
    /// RabbitMQ blocks the connection (resource alarm): nothing is sent or claimed until it
    /// unblocks; what is in flight waits for its confirm without timing out.
    pub broker_blocked: bool,
    nacks_in_a_row: u32,
}

impl<'a> Health<'a> {
    pub fn new(readiness: &'a Readiness) -> Self {
        Self {
            readiness,
            db_failures: 0,
            amqp_failures: 0,
            retry_at: None,
            broker_blocked: false,
            nacks_in_a_row: 0,
        }
    }

    /// When the current backoff ends, if one runs.
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// Ends the backoff if its time has come; true when none runs.
    pub fn backoff_over(&mut self, now: Instant) -> bool {
        if self.retry_at.is_some_and(|t| now >= t) {
            self.retry_at = None;
        }
        self.retry_at.is_none()
    }

    pub fn db_ok(&mut self) {
        self.db_failures = 0;
        self.report(Some(true), None);
    }

    /// A claim or mark failed; returns the attempt number.
    pub fn db_failed(&mut self) -> u32 {
        self.db_failures += 1;
        self.report(Some(false), None);
        self.back_off(self.db_failures);
        self.db_failures
    }

    pub fn amqp_ok(&mut self) {
        self.amqp_failures = 0;
        self.report(None, Some(!self.broker_blocked));
    }

    /// Connecting failed or the link was dropped; returns the attempt number.
    pub fn amqp_failed(&mut self) -> u32 {
        self.amqp_failures += 1;
        self.report(None, Some(false));
        self.back_off(self.amqp_failures);
        self.amqp_failures
    }

    /// An ack: the channel works.
    pub fn acked(&mut self) {
        self.nacks_in_a_row = 0;
    }

    /// A nack; true when so many came in a row that the channel should be replaced.
    pub fn nacked(&mut self) -> bool {
        self.nacks_in_a_row += 1;
        if self.nacks_in_a_row >= NACKS_BEFORE_RECONNECT {
            self.nacks_in_a_row = 0;
            return true;
        }
        false
    }

    /// Follows `connection.blocked`; returns whether it changed.
    pub fn set_blocked(&mut self, blocked: bool, connected: bool) -> bool {
        if blocked == self.broker_blocked {
            return false;
        }
        self.broker_blocked = blocked;
        internal_events::broker_blocked(blocked);
        self.report(None, Some(!blocked && connected));
        true
    }

    fn back_off(&mut self, failures: u32) {
        let d =
            plumbing::backoff::delay(failures, Duration::from_millis(100), Duration::from_secs(5));
        self.retry_at = Some(Instant::now() + d);
    }

    fn report(&self, postgres: Option<bool>, rabbitmq: Option<bool>) {
        internal_events::readiness(self.readiness, postgres, rabbitmq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_back_off_and_success_reports_ready() {
        let readiness = Readiness::new();
        let mut h = Health::new(&readiness);
        assert!(h.backoff_over(Instant::now()));
        assert_eq!(h.db_failed(), 1);
        assert!(!readiness.ready());
        assert!(
            !h.backoff_over(Instant::now()),
            "a failure starts a backoff"
        );
        assert!(h.backoff_over(Instant::now() + Duration::from_secs(6)));
        h.db_ok();
        h.amqp_ok();
        assert!(readiness.ready());
        assert!(h.set_blocked(true, true));
        assert!(!readiness.ready(), "a blocked broker is not ready");
        assert!(!h.set_blocked(true, true));
        assert!(h.set_blocked(false, true));
        assert!(readiness.ready());
    }

    #[test]
    fn a_run_of_nacks_asks_for_a_new_channel() {
        let readiness = Readiness::new();
        let mut h = Health::new(&readiness);
        for _ in 1..NACKS_BEFORE_RECONNECT {
            assert!(!h.nacked());
        }
        h.acked();
        for _ in 1..NACKS_BEFORE_RECONNECT {
            assert!(!h.nacked());
        }
        assert!(h.nacked());
    }
}
