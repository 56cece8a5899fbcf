//! Every metric the producer emits, in one place: names, labels and their meaning.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `api_request_duration_seconds` | histogram | `route` (template, `unmatched` for 404s), `method`, `status` |
//! | `demo_payments_settled_total` | counter | `outcome` (`succeeded`, `failed`): payments the payment process settled (`producer worker`) |
//!
//! The payment process's own metrics (`process_*`) are the processes crate's.
//!
//! The Idempotency-Key metrics (`api_idempotency_outcomes_total`, `api_idempotency_released_total`,
//! `api_idempotency_purged_total`) are the idempotency layer's: see `idempotency::internal_events`.

use std::sync::Once;
use std::time::Duration;

pub const REQUEST_DURATION: &str = "api_request_duration_seconds";
pub const PAYMENTS_SETTLED: &str = "demo_payments_settled_total";

/// Registers descriptions once per process.
pub fn describe() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        metrics::describe_histogram!(
            REQUEST_DURATION,
            metrics::Unit::Seconds,
            "HTTP request duration by route template, method and status"
        );
        metrics::describe_counter!(
            PAYMENTS_SETTLED,
            "Payments the payment process settled, by outcome (counted when the settling transaction is written; a rolled-back attempt may count again)"
        );
    });
}

/// One HTTP request finished.
pub fn request_finished(route: &str, method: &str, status: u16, elapsed: Duration) {
    metrics::histogram!(
        REQUEST_DURATION,
        "route" => route.to_owned(),
        "method" => method.to_owned(),
        "status" => status.to_string(),
    )
    .record(elapsed.as_secs_f64());
}

/// The payment process wrote a payment's final status (`succeeded` or `failed`).
pub fn payment_settled(outcome: &'static str) {
    metrics::counter!(PAYMENTS_SETTLED, "outcome" => outcome).increment(1);
}
