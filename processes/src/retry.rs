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

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            factor: 2.0,
            max_delay: Duration::from_secs(60),
            jitter: true,
            max_attempts: 5,
            deadline: Some(Duration::from_secs(3600)),
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
    fn full_jitter_stays_within_the_delay() {
        let p = RetryPolicy::default().initial(Duration::from_millis(100));
        for _ in 0..100 {
            assert!(p.delay_after(2) <= Duration::from_millis(200));
        }
    }
}
