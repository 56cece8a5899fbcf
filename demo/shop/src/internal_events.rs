//! Every metric the producer emits, in one place: names, labels and their meaning.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `api_request_duration_seconds` | histogram | `route` (template, `unmatched` for 404s), `method`, `status` |
//! | `api_idempotency_outcomes_total` | counter | `operation`, `outcome` (see [`Outcome`]) |
//! | `api_idempotency_released_total` | counter | `operation`, `reason` (`error`, `panic`, `cancelled`) |
//! | `api_idempotency_purged_total` | counter | |

use crate::idempotency::Operation;
use std::sync::Once;
use std::time::Duration;

pub const REQUEST_DURATION: &str = "api_request_duration_seconds";
pub const IDEMPOTENCY_OUTCOMES: &str = "api_idempotency_outcomes_total";
pub const IDEMPOTENCY_RELEASED: &str = "api_idempotency_released_total";
pub const IDEMPOTENCY_PURGED: &str = "api_idempotency_purged_total";

/// What happened to an Idempotency-Key when a POST arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// First use of the key: reserved, the effect runs.
    New,
    /// The key had a stored response: replayed, no new effect.
    Replayed,
    /// The key is held by a request still processing (or a later holder fenced this one out): 409.
    Conflict,
    /// The key was used with another payload: 422, the record untouched.
    Mismatch,
    /// The key's record had expired: it counts as new, the effect runs.
    Expired,
    /// The key's processing lease had expired (its holder died): taken over, the effect runs.
    TakenOver,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::New => "new",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::Expired => "expired",
            Outcome::TakenOver => "taken_over",
        }
    }
}

/// Why a reservation was released without an effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseReason {
    Error,
    Panic,
    Cancelled,
}

impl ReleaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Error => "error",
            ReleaseReason::Panic => "panic",
            ReleaseReason::Cancelled => "cancelled",
        }
    }
}

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
            IDEMPOTENCY_OUTCOMES,
            "Idempotency-Key outcomes of POST requests: new, replayed, conflict, mismatch, expired, taken_over"
        );
        metrics::describe_counter!(
            IDEMPOTENCY_RELEASED,
            "Reservations released without effect (error, panic, cancelled request) so a retry can run"
        );
        metrics::describe_counter!(IDEMPOTENCY_PURGED, "Expired idempotency records deleted by the purge");
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

/// One Idempotency-Key decision.
pub fn idempotency_outcome(operation: Operation, outcome: Outcome) {
    metrics::counter!(
        IDEMPOTENCY_OUTCOMES,
        "operation" => operation.as_str(),
        "outcome" => outcome.as_str(),
    )
    .increment(1);
}

/// A reservation was released (deleted) without an effect.
pub fn reservation_released(operation: Operation, reason: ReleaseReason) {
    metrics::counter!(
        IDEMPOTENCY_RELEASED,
        "operation" => operation.as_str(),
        "reason" => reason.as_str(),
    )
    .increment(1);
}

/// The purge deleted `n` records.
pub fn purged(n: u64) {
    metrics::counter!(IDEMPOTENCY_PURGED).increment(n);
}
