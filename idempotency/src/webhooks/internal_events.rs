//! Every metric of the webhook receiver, in one place.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `webhook_received_total` | counter | `source`, `outcome`: `applied`, `superseded`, `duplicate` |
//! | `webhook_signature_failures_total` | counter | `source`, `reason`: `unsigned`, `malformed`, `mismatch`, `stale` |
//! | `webhook_refused_total` | counter | `source`, `reason`: `body_too_large`, `bad_payload` (signed, but no usable event) |
//! | `webhook_handler_failures_total` | counter | `source`, `cause`: `error`, `panic`, `database` |
//! | `webhook_handle_duration_seconds` | histogram | `source`: verification to commit, of events not refused |

use crate::webhooks::inbox::InboxOutcome;
use std::sync::Once;
use std::time::Duration;

pub const RECEIVED: &str = "webhook_received_total";
pub const SIGNATURE_FAILURES: &str = "webhook_signature_failures_total";
pub const REFUSED: &str = "webhook_refused_total";
pub const HANDLER_FAILURES: &str = "webhook_handler_failures_total";
pub const HANDLE_DURATION: &str = "webhook_handle_duration_seconds";

/// Why an event that passed the signature check was not recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCause {
    /// The service's handler returned an error.
    Error,
    /// The service's handler panicked.
    Panic,
    /// The inbox's own statements or the commit failed.
    Database,
}

impl FailureCause {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::Error => "error",
            FailureCause::Panic => "panic",
            FailureCause::Database => "database",
        }
    }
}

/// Registers descriptions once per process, and every series of `source` (at zero if new).
pub fn describe(source: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        metrics::describe_counter!(
            RECEIVED,
            "Verified webhook events: applied, superseded (older than their object's state) or duplicate"
        );
        metrics::describe_counter!(
            SIGNATURE_FAILURES,
            "Webhooks refused for their signature: unsigned, malformed, mismatch, stale"
        );
        metrics::describe_counter!(
            REFUSED,
            "Webhooks refused for their body: too large, or signed but no usable event"
        );
        metrics::describe_counter!(
            HANDLER_FAILURES,
            "Webhook events rolled back (handler error or panic, database failure): the provider retries"
        );
        metrics::describe_histogram!(
            HANDLE_DURATION,
            metrics::Unit::Seconds,
            "Time from a webhook's verification to its commit"
        );
    });
    for o in [
        InboxOutcome::Applied,
        InboxOutcome::Superseded,
        InboxOutcome::Duplicate,
    ] {
        metrics::counter!(RECEIVED, "source" => source.to_owned(), "outcome" => o.as_str())
            .increment(0);
    }
    for r in ["unsigned", "malformed", "mismatch", "stale"] {
        metrics::counter!(SIGNATURE_FAILURES, "source" => source.to_owned(), "reason" => r)
            .increment(0);
    }
    for r in ["body_too_large", "bad_payload"] {
        metrics::counter!(REFUSED, "source" => source.to_owned(), "reason" => r).increment(0);
    }
    for c in [
        FailureCause::Error,
        FailureCause::Panic,
        FailureCause::Database,
    ] {
        metrics::counter!(HANDLER_FAILURES, "source" => source.to_owned(), "cause" => c.as_str())
            .increment(0);
    }
}

pub fn received(source: &str, outcome: InboxOutcome, took: Duration) {
    metrics::counter!(RECEIVED, "source" => source.to_owned(), "outcome" => outcome.as_str())
        .increment(1);
    metrics::histogram!(HANDLE_DURATION, "source" => source.to_owned()).record(took.as_secs_f64());
}

pub fn signature_failure(source: &str, reason: &'static str) {
    metrics::counter!(SIGNATURE_FAILURES, "source" => source.to_owned(), "reason" => reason)
        .increment(1);
}

pub fn refused(source: &str, reason: &'static str) {
    metrics::counter!(REFUSED, "source" => source.to_owned(), "reason" => reason).increment(1);
}

pub fn handler_failure(source: &str, cause: FailureCause) {
    metrics::counter!(HANDLER_FAILURES, "source" => source.to_owned(), "cause" => cause.as_str())
        .increment(1);
}
