//! What a dependency's circuit and limits do: when it opens, how long it cools down, how fast
//! waiting work resumes, and the optional concurrency cap and rate limit. The policy is the
//! application's (in its code, the same in every instance); the state it drives is shared in
//! PostgreSQL.

use crate::error::PolicyError;
use std::time::Duration;

/// Open on a share of unavailable answers within a window (besides the consecutive rule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FailureRate {
    /// Share of unavailable answers, in (0, 1], that opens the circuit.
    pub ratio: f64,
    /// Length of the counting window.
    pub window: Duration,
    /// Fewer answers than this in a window never open it.
    pub min_calls: u32,
}

/// A token bucket: `per_second` calls on average, `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: u32,
}

/// How a dependency's circuit and limits behave. The defaults suit a payment provider or an
/// HTTP API: open after 5 unavailable answers in a row, a first probe after 2 s, cool-downs
/// doubling up to a minute, waiting work resumed at 20 calls a second, no cap and no rate limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// Unavailable answers in a row that open the circuit.
    pub consecutive: u32,
    /// Optional: also open on a failure rate over a window (costs one write per call).
    pub failure_rate: Option<FailureRate>,
    /// The first cool-down after the circuit opens.
    pub cooldown: Duration,
    /// The longest cool-down: each failed probe doubles the cool-down up to this.
    pub max_cooldown: Duration,
    /// Waiting work woken per second once the circuit lets calls through (oldest first), so a
    /// recovery is no thundering herd.
    pub resume_per_second: u32,
    /// Optional: most calls in flight at once, across all instances.
    pub concurrency: Option<u32>,
    /// Optional: a token bucket across all instances.
    pub rate: Option<RateLimit>,
    /// How long a read of the shared state is trusted before it is read again (0: every call
    /// reads it). A closed circuit seen by one instance is seen by the others within this.
    pub cache_for: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            consecutive: 5,
            failure_rate: None,
            cooldown: Duration::from_secs(2),
            max_cooldown: Duration::from_secs(60),
            resume_per_second: 20,
            concurrency: None,
            rate: None,
            cache_for: Duration::from_millis(250),
        }
    }
}

impl Policy {
    pub fn consecutive(mut self, n: u32) -> Self {
        self.consecutive = n;
        self
    }
    pub fn failure_rate(mut self, ratio: f64, window: Duration, min_calls: u32) -> Self {
        self.failure_rate = Some(FailureRate {
            ratio,
            window,
            min_calls,
        });
        self
    }
    pub fn cooldown(mut self, first: Duration, max: Duration) -> Self {
        self.cooldown = first;
        self.max_cooldown = max;
        self
    }
    pub fn resume_per_second(mut self, n: u32) -> Self {
        self.resume_per_second = n;
        self
    }
    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = Some(n);
        self
    }
    pub fn rate(mut self, per_second: f64, burst: u32) -> Self {
        self.rate = Some(RateLimit { per_second, burst });
        self
    }
    pub fn cache_for(mut self, d: Duration) -> Self {
        self.cache_for = d;
        self
    }

    /// Refuses a policy that cannot work, with the rule it breaks.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let fail = |rule: &str| Err(PolicyError(rule.to_string()));
        if self.consecutive == 0 {
            return fail("consecutive must be at least 1 (0 would open on no answer at all)");
        }
        if self.cooldown.is_zero() || self.cooldown > self.max_cooldown {
            return fail("cooldown must be positive and at most max_cooldown");
        }
        if self.max_cooldown > Duration::from_secs(24 * 3600) {
            return fail("max_cooldown must be at most 24 h");
        }
        if self.resume_per_second == 0 {
            return fail(
                "resume_per_second must be at least 1 (0 would never resume waiting work)",
            );
        }
        if let Some(r) = self.failure_rate
            && (!(r.ratio > 0.0 && r.ratio <= 1.0) || r.window.is_zero() || r.min_calls == 0)
        {
            return fail(
                "failure_rate needs a ratio in (0, 1], a positive window and min_calls >= 1",
            );
        }
        if self.concurrency == Some(0) || self.concurrency.is_some_and(|n| n > 10_000) {
            return fail("concurrency must be 1 to 10000");
        }
        if let Some(r) = self.rate
            && (!(r.per_second.is_finite() && r.per_second > 0.0) || r.burst == 0)
        {
            return fail("rate needs a positive per_second and a burst of at least 1");
        }
        Ok(())
    }

    /// The cool-down after `current` when another probe failed: doubled, at most the maximum.
    pub fn next_cooldown(&self, current: Duration) -> Duration {
        if current.is_zero() {
            self.cooldown
        } else {
            current.saturating_mul(2).min(self.max_cooldown)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid_and_impossible_policies_are_refused_with_their_rule() {
        assert!(Policy::default().validate().is_ok());
        let e = Policy::default().consecutive(0).validate().unwrap_err();
        assert!(e.to_string().contains("consecutive"), "{e}");
        assert!(Policy::default().resume_per_second(0).validate().is_err());
        assert!(
            Policy::default()
                .cooldown(Duration::from_secs(5), Duration::from_secs(1))
                .validate()
                .is_err()
        );
        assert!(Policy::default().concurrency(0).validate().is_err());
        assert!(Policy::default().rate(0.0, 1).validate().is_err());
        assert!(Policy::default().rate(f64::NAN, 1).validate().is_err());
        assert!(
            Policy::default()
                .failure_rate(1.5, Duration::from_secs(10), 5)
                .validate()
                .is_err()
        );
    }

    #[test]
    fn cooldowns_double_up_to_the_maximum() {
        let p = Policy::default().cooldown(Duration::from_secs(2), Duration::from_secs(10));
        assert_eq!(p.next_cooldown(Duration::ZERO), Duration::from_secs(2));
        assert_eq!(
            p.next_cooldown(Duration::from_secs(2)),
            Duration::from_secs(4)
        );
        assert_eq!(
            p.next_cooldown(Duration::from_secs(8)),
            Duration::from_secs(10)
        );
        assert_eq!(
            p.next_cooldown(Duration::from_secs(10)),
            Duration::from_secs(10)
        );
    }
}
