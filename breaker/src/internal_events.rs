//! Every metric of the dependencies, in one place, with fixed label sets (the dependency's name
//! is the application's, a handful per service).

use crate::circuit::{Circuit, WaitReason};
use crate::state::CircuitState;
use metrics::{Unit, counter, describe_counter, describe_gauge, gauge};

pub fn describe() {
    describe_gauge!(
        "dependency_circuit_state",
        "A dependency's shared circuit: 0 closed, 1 half open (a probe in flight), 2 open"
    );
    describe_gauge!(
        "dependency_circuit_forced_open",
        "1 while an operator holds the dependency's circuit open"
    );
    describe_gauge!(
        "dependency_open_seconds",
        Unit::Seconds,
        "How long the dependency has been down (since its circuit opened for the current outage); 0 while closed"
    );
    describe_counter!(
        "dependency_calls_total",
        "Calls made to a dependency, by what their answer said of its health (answered, unavailable, no_answer)"
    );
    describe_counter!(
        "dependency_calls_refused_total",
        "Calls not made because of the dependency's circuit or limits, by reason (open, probing, forced_open, rate_limited, saturated)"
    );
    describe_counter!(
        "dependency_transitions_total",
        "Changes of a dependency's circuit state, by the state entered"
    );
    describe_gauge!(
        "dependency_rate_tokens",
        "Tokens in the dependency's rate-limit bucket (at the last call or statistics refresh)"
    );
    describe_gauge!(
        "dependency_slots_in_use",
        "Concurrency slots of the dependency held now, across all instances"
    );
    describe_gauge!(
        "dependency_slots",
        "The dependency's concurrency cap (its slots)"
    );
}

/// The circuit as last read or written.
pub fn circuit(name: &str, c: &Circuit) {
    let dep = name.to_string();
    gauge!("dependency_circuit_state", "dependency" => dep.clone()).set(c.state.gauge());
    gauge!("dependency_circuit_forced_open", "dependency" => dep.clone())
        .set(f64::from(u8::from(c.forced_open)));
    let open = c
        .down_since
        .map(|t| (chrono::Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0)
        .unwrap_or(0.0);
    gauge!("dependency_open_seconds", "dependency" => dep).set(open);
}

/// The call counters of a dependency: answered, unavailable, no_answer.
pub fn call_counters(name: &str) -> [metrics::Counter; 3] {
    ["answered", "unavailable", "no_answer"].map(|outcome| {
        counter!("dependency_calls_total", "dependency" => name.to_string(), "outcome" => outcome)
    })
}

pub fn refused(name: &str, reason: &WaitReason) {
    counter!("dependency_calls_refused_total", "dependency" => name.to_string(), "reason" => reason.as_str())
        .increment(1);
}

pub fn transition(name: &str, to: CircuitState) {
    counter!("dependency_transitions_total", "dependency" => name.to_string(), "to" => to.as_str())
        .increment(1);
}

pub fn tokens(name: &str, tokens: f64) {
    gauge!("dependency_rate_tokens", "dependency" => name.to_string()).set(tokens.max(0.0));
}

/// Concurrency slots held now (`held`) of the cap `cap`.
pub fn slots(name: &str, held: i64, cap: u32) {
    gauge!("dependency_slots_in_use", "dependency" => name.to_string()).set(held as f64);
    gauge!("dependency_slots", "dependency" => name.to_string()).set(f64::from(cap));
}
