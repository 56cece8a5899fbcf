//! Every metric the process workers emit, in one place, with fixed label sets.

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use std::time::Duration;

pub fn describe() {
    describe_counter!(
        "process_dependency_waits_total",
        "Steps parked because their dependency's circuit or limits would not let the call go, by kind, dependency and reason"
    );
    describe_gauge!(
        "process_steps_waiting",
        "Steps waiting for a dependency's circuit (waiting_for), by dependency"
    );
    describe_gauge!(
        "process_steps_waiting_oldest_seconds",
        Unit::Seconds,
        "How long the step waiting longest for a dependency has waited, by dependency"
    );
    describe_gauge!(
        "processes_active",
        "Processes not yet finished, by kind and status"
    );
    describe_counter!(
        "processes_finished_total",
        "Processes that reached a final or review status, by kind and status"
    );
    describe_counter!(
        "process_step_attempts_total",
        "Step attempts, by kind, step, outcome and error class"
    );
    describe_counter!(
        "process_unknown_outcomes_total",
        "Attempts whose outcome is unknown (timeout, lost worker), by kind, step and how they are resolved"
    );
    describe_gauge!(
        "process_manual_review_backlog",
        "Processes waiting in manual_review"
    );
    describe_gauge!(
        "process_manual_review_oldest_age_seconds",
        Unit::Seconds,
        "How long the process waiting longest has been in manual_review (since it went there, as the console shows it)"
    );
    describe_counter!(
        "process_lease_takeovers_total",
        "Claims that took over an expired lease of another worker, by kind"
    );
    describe_counter!(
        "process_fenced_writes_total",
        "Writes refused because the lease was taken over, by kind"
    );
    describe_histogram!(
        "process_step_duration_seconds",
        Unit::Seconds,
        "Duration of one step attempt, by kind and step"
    );
    describe_histogram!(
        "process_latency_seconds",
        Unit::Seconds,
        "Start to finish of a process, by kind and final status"
    );
    describe_gauge!(
        "process_unknown_version_due",
        "Due processes of a definition version this worker does not have, by kind and version"
    );
    describe_counter!("process_claims_total", "Processes claimed by this worker");
    describe_counter!(
        "process_waits_begun_total",
        "Wait or timer steps that parked their process, by kind, step and what they wait for (event, timer)"
    );
    describe_counter!(
        "process_waits_ended_total",
        "Wait steps that ended, by kind, step and how (event, query, manual_review)"
    );
}

/// A wait or timer step parked its process (`what`: event or timer).
pub fn wait_began(kind: &str, step: &str, what: &'static str) {
    counter!("process_waits_begun_total", "kind" => kind.to_string(), "step" => step.to_string(), "what" => what)
        .increment(1);
}

/// A wait step ended (`how`: event, query, manual_review).
pub fn wait_ended(kind: &str, step: &str, how: &'static str) {
    counter!("process_waits_ended_total", "kind" => kind.to_string(), "step" => step.to_string(), "how" => how)
        .increment(1);
}

/// A process was claimed; `takeover` if it took over another worker's expired lease.
pub fn claimed(kind: &str, takeover: bool) {
    counter!("process_claims_total").increment(1);
    if takeover {
        counter!("process_lease_takeovers_total", "kind" => kind.to_string()).increment(1);
    }
}

/// One step attempt ended with `outcome` (succeeded, retryable, failed, manual_review, found).
pub fn step_attempt(
    kind: &str,
    step: &str,
    outcome: &'static str,
    class: &'static str,
    took: Duration,
) {
    counter!("process_step_attempts_total", "kind" => kind.to_string(), "step" => step.to_string(),
        "outcome" => outcome, "error_class" => class)
    .increment(1);
    histogram!("process_step_duration_seconds", "kind" => kind.to_string(), "step" => step.to_string())
        .record(took.as_secs_f64());
}

/// An outcome is unknown; `resolution` is how it is being resolved (retry_with_key, query, manual_review).
pub fn unknown_outcome(kind: &str, step: &str, resolution: &'static str) {
    counter!("process_unknown_outcomes_total", "kind" => kind.to_string(), "step" => step.to_string(),
        "resolution" => resolution)
    .increment(1);
}

/// A write was fenced off: this worker's lease had been taken over.
pub fn fenced(kind: &str) {
    counter!("process_fenced_writes_total", "kind" => kind.to_string()).increment(1);
}

/// A process reached `status` (succeeded, failed, compensated, manual_review) `latency` after its start.
pub fn finished(kind: &str, status: &'static str, latency: Duration) {
    counter!("processes_finished_total", "kind" => kind.to_string(), "status" => status)
        .increment(1);
    histogram!("process_latency_seconds", "kind" => kind.to_string(), "status" => status)
        .record(latency.as_secs_f64());
}

pub fn active(kind: &str, status: &str, n: i64) {
    gauge!("processes_active", "kind" => kind.to_string(), "status" => status.to_string())
        .set(n as f64);
}

pub fn manual_review(backlog: i64, oldest_age: Duration) {
    gauge!("process_manual_review_backlog").set(backlog as f64);
    gauge!("process_manual_review_oldest_age_seconds").set(oldest_age.as_secs_f64());
}

pub fn unknown_version(kind: &str, version: i32, due: i64) {
    gauge!("process_unknown_version_due", "kind" => kind.to_string(), "version" => version.to_string())
        .set(due as f64);
}

/// A step parked for its dependency (`reason`: open, probing, forced_open, rate_limited, saturated).
pub fn dependency_wait(kind: &str, dependency: &str, reason: &'static str) {
    counter!("process_dependency_waits_total", "kind" => kind.to_string(),
        "dependency" => dependency.to_string(), "reason" => reason)
    .increment(1);
}

/// Steps waiting for `dependency`, and how long the oldest has waited.
pub fn waiting(dependency: &str, n: i64, oldest: Duration) {
    gauge!("process_steps_waiting", "dependency" => dependency.to_string()).set(n as f64);
    gauge!("process_steps_waiting_oldest_seconds", "dependency" => dependency.to_string())
        .set(oldest.as_secs_f64());
}
