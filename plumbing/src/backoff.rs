//! Exponential backoff with full jitter (AWS style): `random(0, min(max, base * 2^attempt))`,
//! never below a tenth of the exponential step so retries do not bunch up at zero.

use rand::Rng;
use std::time::Duration;

/// Delay before retry number `attempt` (1-based).
pub fn delay(attempt: u32, base: Duration, max: Duration) -> Duration {
    let exp = base.saturating_mul(
        1u32.checked_shl(attempt.saturating_sub(1).min(30))
            .unwrap_or(u32::MAX),
    );
    let cap = exp.min(max);
    let floor = cap / 10;
    let span = cap.saturating_sub(floor);
    let jitter = rand::rng().random_range(0.0..=1.0);
    floor + span.mul_f64(jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_is_capped() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(5);
        for attempt in 1..40 {
            let d = delay(attempt, base, max);
            assert!(d <= max, "attempt {attempt}: {d:?}");
            let step = base.saturating_mul(1 << (attempt - 1).min(30)).min(max);
            assert!(d >= step / 10, "attempt {attempt}: {d:?} below floor");
        }
    }
}
