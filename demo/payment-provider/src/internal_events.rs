//! Every metric and log event of the simulator, in one place.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `provider_charges_total` | counter | `outcome`: `succeeded`, `declined`, `replayed`, `key_mismatch`, `unavailable` (error_before_charge) |
//! | `provider_faults_injected_total` | counter | `mode`: one of the fault modes |
//! | `provider_refunds_total` | counter | `outcome`: `refunded`, `replayed`, `not_refundable`, `not_found` |

use crate::faults::{FaultMode, FaultSet};

pub const CHARGES: &str = "provider_charges_total";
pub const FAULTS_INJECTED: &str = "provider_faults_injected_total";
pub const REFUNDS: &str = "provider_refunds_total";

/// What a `POST /charges` ended as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChargeOutcome {
    Succeeded,
    Declined,
    Replayed,
    KeyMismatch,
    Unavailable,
}

impl ChargeOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            ChargeOutcome::Succeeded => "succeeded",
            ChargeOutcome::Declined => "declined",
            ChargeOutcome::Replayed => "replayed",
            ChargeOutcome::KeyMismatch => "key_mismatch",
            ChargeOutcome::Unavailable => "unavailable",
        }
    }
}

/// Registers every series at zero, so that dashboards see them before the first event.
pub fn describe() {
    // The recorder must exist first, or these registrations go nowhere.
    let _ = plumbing::telemetry::metrics_handle();
    for o in [
        ChargeOutcome::Succeeded,
        ChargeOutcome::Declined,
        ChargeOutcome::Replayed,
        ChargeOutcome::KeyMismatch,
        ChargeOutcome::Unavailable,
    ] {
        metrics::counter!(CHARGES, "outcome" => o.as_str()).absolute(0);
    }
    for m in FaultMode::ALL {
        metrics::counter!(FAULTS_INJECTED, "mode" => m.as_str()).absolute(0);
    }
    for o in ["refunded", "replayed", "not_refundable", "not_found"] {
        metrics::counter!(REFUNDS, "outcome" => o).absolute(0);
    }
}

pub fn charge(outcome: ChargeOutcome) {
    metrics::counter!(CHARGES, "outcome" => outcome.as_str()).increment(1);
}

pub fn fault_injected(mode: FaultMode, reference: &str) {
    metrics::counter!(FAULTS_INJECTED, "mode" => mode.as_str()).increment(1);
    tracing::info!(mode = mode.as_str(), reference, "fault injected");
}

pub fn refund(outcome: &'static str) {
    metrics::counter!(REFUNDS, "outcome" => outcome).increment(1);
}

pub fn faults_changed(set: &FaultSet) {
    tracing::info!(faults = %set, "faults changed");
}

pub fn listening(
    addr: std::net::SocketAddr,
    set: &FaultSet,
    idempotency: bool,
    status_query: bool,
) {
    tracing::info!(%addr, faults = %set, idempotency, status_query, "payment provider listening");
}
