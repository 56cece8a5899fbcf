//! The console's telemetry: every metric and log event, with fixed label sets.
//!
//! - `console_actions_total{action, outcome}`: actions by outcome (succeeded, requested, approved,
//!   rejected, denied, conflict, failed). Replays of an Idempotency-Key are the idempotency
//!   crate's `api_idempotency_outcomes_total{outcome="replayed"}`: no action runs.
//! - `console_approvals_pending`: approval requests waiting for a decision.
//! - `console_login_failures_total{reason}`: failed web logins (`invalid_token`, `rate_limited`).
//! - `console_cross_site_refused_total`: POSTs refused for a foreign `Origin` / `Sec-Fetch-Site`.

use crate::auth::users::Principal;

pub fn action(actor: &Principal, action: &str, target: &str, outcome: &'static str) {
    metrics::counter!("console_actions_total", "action" => action.to_string(), "outcome" => outcome)
        .increment(1);
    tracing::info!(
        actor = %actor.name,
        actor_id = %actor.id,
        role = %actor.role,
        action,
        target = %crate::redact::text(target),
        outcome,
        "console action"
    );
}

pub fn approvals_pending(n: i64) {
    metrics::gauge!("console_approvals_pending").set(n as f64);
}

pub fn login_failed(reason: &'static str, addr: std::net::IpAddr) {
    metrics::counter!("console_login_failures_total", "reason" => reason).increment(1);
    tracing::warn!(%addr, reason, "console login failed");
}

pub fn cross_site_refused() {
    metrics::counter!("console_cross_site_refused_total").increment(1);
}

pub fn login(actor: &Principal) {
    tracing::info!(actor = %actor.name, actor_id = %actor.id, role = %actor.role, "console login");
}

/// Registers the series so they exist (at zero) before the first event.
pub fn describe() {
    metrics::describe_counter!(
        "console_actions_total",
        "Console actions by action and outcome"
    );
    metrics::describe_gauge!(
        "console_approvals_pending",
        "Approval requests waiting for a decision"
    );
    metrics::describe_counter!(
        "console_login_failures_total",
        "Failed console logins by reason"
    );
    metrics::counter!("console_login_failures_total", "reason" => "invalid_token").increment(0);
    metrics::describe_counter!(
        "console_cross_site_refused_total",
        "POSTs refused as cross-site (Origin, Sec-Fetch-Site)"
    );
    metrics::counter!("console_cross_site_refused_total").increment(0);
}
