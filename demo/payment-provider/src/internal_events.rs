//! Every metric and log event of the simulator, in one place.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `provider_charges_total` | counter | `outcome`: `succeeded`, `declined`, `pending` (async mode), `replayed`, `key_mismatch`, `unavailable` (error_before_charge) |
//! | `provider_faults_injected_total` | counter | `mode`: one of the fault modes |
//! | `provider_refunds_total` | counter | `outcome`: `refunded`, `replayed`, `not_refundable`, `not_found` |
//! | `provider_webhook_events_total` | counter | `type`: `charge.succeeded`, `charge.failed`, `charge.refunded` (recorded) |
//! | `provider_webhook_deliveries_total` | counter | `outcome`: `delivered`, `failed` (will retry), `gave_up`, `duplicate` (webhook_duplicate copy sent) |

use crate::api::EventType;
use crate::faults::{FaultMode, FaultSet};
use crate::mode::ConfirmationMode;

pub const CHARGES: &str = "provider_charges_total";
pub const FAULTS_INJECTED: &str = "provider_faults_injected_total";
pub const REFUNDS: &str = "provider_refunds_total";
pub const WEBHOOK_EVENTS: &str = "provider_webhook_events_total";
pub const WEBHOOK_DELIVERIES: &str = "provider_webhook_deliveries_total";

/// What one delivery attempt of a webhook event ended as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryOutcome {
    Delivered,
    Failed,
    GaveUp,
    Duplicate,
}

impl DeliveryOutcome {
    pub const ALL: [DeliveryOutcome; 4] = [
        DeliveryOutcome::Delivered,
        DeliveryOutcome::Failed,
        DeliveryOutcome::GaveUp,
        DeliveryOutcome::Duplicate,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryOutcome::Delivered => "delivered",
            DeliveryOutcome::Failed => "failed",
            DeliveryOutcome::GaveUp => "gave_up",
            DeliveryOutcome::Duplicate => "duplicate",
        }
    }
}

/// What a `POST /charges` ended as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChargeOutcome {
    Succeeded,
    Declined,
    /// Async mode: accepted, to be decided.
    Pending,
    Replayed,
    KeyMismatch,
    Unavailable,
}

impl ChargeOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            ChargeOutcome::Succeeded => "succeeded",
            ChargeOutcome::Declined => "declined",
            ChargeOutcome::Pending => "pending",
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
        ChargeOutcome::Pending,
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
    for t in [
        EventType::ChargeSucceeded,
        EventType::ChargeFailed,
        EventType::ChargeRefunded,
    ] {
        metrics::counter!(WEBHOOK_EVENTS, "type" => t.as_str()).absolute(0);
    }
    for o in DeliveryOutcome::ALL {
        metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => o.as_str()).absolute(0);
    }
}

pub fn event_recorded(kind: EventType) {
    metrics::counter!(WEBHOOK_EVENTS, "type" => kind.as_str()).increment(1);
}

pub fn delivery(outcome: DeliveryOutcome) {
    metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => outcome.as_str()).increment(1);
}

pub fn mode_changed(mode: ConfirmationMode) {
    tracing::info!(%mode, "confirmation mode changed");
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

/// A call refused by the outage switch.
pub fn outage_refused(status: u16) {
    metrics::counter!("provider_outage_refused_total", "status" => status.to_string()).increment(1);
}

pub fn outage_changed(setting: crate::outage::OutageSetting) {
    tracing::info!(outage = %setting, "outage switch changed");
}

pub fn faults_changed(set: &FaultSet) {
    tracing::info!(faults = %set, "faults changed");
}

pub fn listening(
    addr: std::net::SocketAddr,
    set: &FaultSet,
    idempotency: bool,
    status_query: bool,
    mode: ConfirmationMode,
    webhook_url: Option<&str>,
) {
    tracing::info!(%addr, faults = %set, idempotency, status_query, %mode, webhook_url, "payment provider listening");
}
