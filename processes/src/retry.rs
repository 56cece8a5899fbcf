//! Retry policy: exponential backoff with full jitter, an attempt limit and an overall deadline.

use rand::Rng;
use std::time::Duration;

/// When a step is tried again after a transient error (or an unknown outcome the remote lets us
/// retry).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Delay before the second attempt (before jitter).
    pub initial: Duration,
    /// Growth of the delay per attempt.
    pub factor: f64,
    /// Upper bound of the delay.
    pub max_delay: Duration,
    /// Full jitter: the delay is uniform in [0, computed delay].
    pub jitter: bool,
    /// Attempts in total, the first included.
    pub max_attempts: i32,
    /// No attempt starts later than this after the first one.
    pub deadline: Option<Duration>,
}

/// The defaults, after Temporal's activity policy: 1 s doubling to at most 100 s between tries,
/// 10 attempts for real failures (about 6 minutes of them), and a business deadline of 24 hours
/// from the first attempt. An unavailable remote (503, 429, connection refused, or an open
/// circuit) spends no attempts: a step waits out a two-minute or a twenty-minute outage without
/// anybody, and only the deadline ends the wait.
impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            factor: 2.0,
            max_delay: Duration::from_secs(100),
            jitter: true,
            max_attempts: 10,
            deadline: Some(Duration::from_secs(24 * 3600)),
        }
    }
}

impl RetryPolicy {
    /// Delay after attempt `attempt` (1-based) failed.
    pub fn delay_after(&self, attempt: i32) -> Duration {
        let exp = self
            .factor
            .max(1.0)
            .powi(attempt.saturating_sub(1).clamp(0, 60));
        let base = self.initial.as_secs_f64() * exp;
        let capped = base.min(self.max_delay.as_secs_f64()).max(0.0);
        let secs = if self.jitter && capped > 0.0 {
            rand::rng().random_range(0.0..=capped)
        } else {
            capped
        };
        // `max_delay` may be `Duration::MAX`, which an f64 of seconds rounds past.
        Duration::try_from_secs_f64(secs).unwrap_or(self.max_delay)
    }

    /// How long a step whose remote answered "unavailable" waits before it looks again, when no
    /// circuit wakes it: half the time it has waited so far (at least `initial`, at most
    /// `max_delay`), jittered down by up to half, and never before the remote's `retry_after`.
    /// So a long outage is asked about less and less often, and never more than once per
    /// `max_delay` less often than it ends.
    pub fn unavailable_delay(&self, waited: Duration, retry_after: Option<Duration>) -> Duration {
        let base = (waited / 2).max(self.initial).min(self.max_delay);
        let d = if self.jitter && !base.is_zero() {
            base.mul_f64(rand::rng().random_range(0.5..=1.0))
        } else {
            base
        };
        retry_after.map_or(d, |r| d.max(r))
    }

    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n.max(1);
        self
    }
    pub fn initial(mut self, d: Duration) -> Self {
        self.initial = d;
        self
    }
    pub fn factor(mut self, f: f64) -> Self {
        self.factor = f;
        self
    }
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.max_delay = d;
        self
    }
    pub fn jitter(mut self, on: bool) -> Self {
        self.jitter = on;
        self
    }
    pub fn deadline(mut self, d: Option<Duration>) -> Self {
        self.deadline = d;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delay_without_bound_never_panics() {
        let p = RetryPolicy::default()
            .initial(Duration::MAX)
            .max_delay(Duration::MAX)
            .jitter(false);
        assert_eq!(p.delay_after(60), Duration::MAX);
    }

    #[test]
    fn grows_and_caps_without_jitter() {
        let p = RetryPolicy::default()
            .jitter(false)
            .initial(Duration::from_millis(100))
            .max_delay(Duration::from_millis(350));
        assert_eq!(p.delay_after(1), Duration::from_millis(100));
        assert_eq!(p.delay_after(2), Duration::from_millis(200));
        assert_eq!(p.delay_after(3), Duration::from_millis(350));
        assert_eq!(p.delay_after(30), Duration::from_millis(350));
    }

    #[test]
    fn an_unavailable_remote_is_asked_less_often_the_longer_it_is_down() {
        let p = RetryPolicy::default().jitter(false);
        assert_eq!(
            p.unavailable_delay(Duration::ZERO, None),
            Duration::from_secs(1)
        );
        assert_eq!(
            p.unavailable_delay(Duration::from_secs(60), None),
            Duration::from_secs(30)
        );
        assert_eq!(
            p.unavailable_delay(Duration::from_secs(3600), None),
            Duration::from_secs(100),
            "capped at max_delay"
        );
        assert_eq!(
            p.unavailable_delay(Duration::ZERO, Some(Duration::from_secs(7))),
            Duration::from_secs(7),
            "never before Retry-After"
        );
        let jittered = RetryPolicy::default();
        for _ in 0..100 {
            let d = jittered.unavailable_delay(Duration::from_secs(60), None);
            assert!(
                d >= Duration::from_secs(15) && d <= Duration::from_secs(30),
                "{d:?}"
            );
        }
    }

    #[test]
    fn full_jitter_stays_within_the_delay() {
        let p = RetryPolicy::default().initial(Duration::from_millis(100));
        for _ in 0..100 {
            assert!(p.delay_after(2) <= Duration::from_millis(200));
        }
    }
}
