//! Every metric the layer emits, in one place: names, labels and their meaning. The names keep the
//! `api_` prefix the dashboards and alerts in `deploy/` use.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `api_idempotency_outcomes_total` | counter | `operation`, `outcome` (see [`Outcome`]) |
//! | `api_idempotency_released_total` | counter | `operation`, `reason` (`error`, `panic`, `cancelled`) |
//! | `api_idempotency_purged_total` | counter | |

use std::sync::Once;

pub const IDEMPOTENCY_OUTCOMES: &str = "api_idempotency_outcomes_total";
pub const IDEMPOTENCY_RELEASED: &str = "api_idempotency_released_total";
pub const IDEMPOTENCY_PURGED: &str = "api_idempotency_purged_total";

/// What happened to an Idempotency-Key when a request arrived.
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
    /// The handler answered with a response that is not stored (5xx, 401, 409, 429...) or the
    /// layer failed around it.
    Error,
    /// The handler panicked.
    Panic,
    /// The request was dropped mid-flight (client gone, server shutting down).
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
        metrics::describe_counter!(
            IDEMPOTENCY_OUTCOMES,
            "Idempotency-Key outcomes of requests: new, replayed, conflict, mismatch, expired, taken_over"
        );
        metrics::describe_counter!(
            IDEMPOTENCY_RELEASED,
            "Reservations released without effect (error, panic, cancelled request) so a retry can run"
        );
        metrics::describe_counter!(
            IDEMPOTENCY_PURGED,
            "Expired idempotency records deleted by the purge"
        );
    });
}

/// One Idempotency-Key decision.
pub fn idempotency_outcome(operation: &str, outcome: Outcome) {
    metrics::counter!(
        IDEMPOTENCY_OUTCOMES,
        "operation" => operation.to_owned(),
        "outcome" => outcome.as_str(),
    )
    .increment(1);
}

/// A reservation was released (deleted) without an effect.
pub fn reservation_released(operation: &str, reason: ReleaseReason) {
    metrics::counter!(
        IDEMPOTENCY_RELEASED,
        "operation" => operation.to_owned(),
        "reason" => reason.as_str(),
    )
    .increment(1);
}

/// The purge deleted `n` records.
pub fn purged(n: u64) {
    metrics::counter!(IDEMPOTENCY_PURGED).increment(n);
}
