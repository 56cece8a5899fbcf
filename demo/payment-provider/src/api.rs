//! The wire types of the provider's HTTP API, shared by the server and [`crate::client`].

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// What became of a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChargeStatus {
    /// Async mode: accepted (202), not decided yet; a webhook event will say how it ended.
    Pending,
    /// The money was taken.
    Succeeded,
    /// Definitively refused; nothing was taken. Retrying the same request gives the same answer.
    Declined,
    /// Taken, then given back by `POST /refunds`.
    Refunded,
}

impl ChargeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ChargeStatus::Pending => "pending",
            ChargeStatus::Succeeded => "succeeded",
            ChargeStatus::Declined => "declined",
            ChargeStatus::Refunded => "refunded",
        }
    }

    /// The status stored in `provider.charges.status`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(ChargeStatus::Pending),
            "succeeded" => Some(ChargeStatus::Succeeded),
            "declined" => Some(ChargeStatus::Declined),
            "refunded" => Some(ChargeStatus::Refunded),
            _ => None,
        }
    }
}

/// A charge as the provider reports it (`POST /charges`, `GET /charges/{id}`, lists).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    pub id: Uuid,
    /// The caller's reference (stable across its retries).
    pub reference: String,
    /// Minor units (cents).
    pub amount: i64,
    pub currency: String,
    pub status: ChargeStatus,
    pub created_at: DateTime<Utc>,
    pub refunded_at: Option<DateTime<Utc>>,
}

/// The body of `POST /charges`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChargeRequest {
    /// Minor units (cents), 1 or more.
    pub amount: i64,
    /// ISO 4217 code, three capital letters.
    pub currency: String,
    /// 1-200 characters, no control characters.
    pub reference: String,
}

/// The body of `POST /refunds`: the whole charge is refunded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefundRequest {
    pub charge_id: Uuid,
}

/// A refund (`POST /refunds`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refund {
    pub id: Uuid,
    pub charge_id: Uuid,
    pub amount: i64,
    pub created_at: DateTime<Utc>,
}

/// The body of `POST /admin/faults` and the answer of `GET /admin/faults`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsBody {
    /// `mode:percent,...`; an empty string clears every fault.
    pub faults: String,
}

/// The body of `POST /admin/outage` and the answer of `GET /admin/outage`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OutageBody {
    /// `off`, `503` or `429`, optionally with `:<Retry-After seconds>` (`503:5`).
    pub outage: String,
}

/// The body of `POST /admin/mode` and the answer of `GET /admin/mode`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModeBody {
    pub mode: crate::mode::ConfirmationMode,
}

/// What a webhook event says happened to a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventType {
    #[serde(rename = "charge.succeeded")]
    ChargeSucceeded,
    /// The charge was declined (its status is `declined`).
    #[serde(rename = "charge.failed")]
    ChargeFailed,
    #[serde(rename = "charge.refunded")]
    ChargeRefunded,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::ChargeSucceeded => "charge.succeeded",
            EventType::ChargeFailed => "charge.failed",
            EventType::ChargeRefunded => "charge.refunded",
        }
    }

    /// The value stored in `provider.events.type`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "charge.succeeded" => Some(EventType::ChargeSucceeded),
            "charge.failed" => Some(EventType::ChargeFailed),
            "charge.refunded" => Some(EventType::ChargeRefunded),
            _ => None,
        }
    }
}

/// The body of a webhook event, as POSTed to `PROVIDER_WEBHOOK_URL` (Stripe's shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookEvent {
    /// `evt_` + 32 hex digits, unique per event; a duplicate or retry carries the same id.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: EventType,
    /// When it happened, in Unix seconds.
    pub created: i64,
    pub data: EventData,
}

/// The object of an event: the charge as it was right after the change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventData {
    pub object: Charge,
}

/// Where an event's delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    /// To be sent (again) at `next_attempt_at`.
    Scheduled,
    /// A 2xx came back.
    Delivered,
    /// Given up after `PROVIDER_WEBHOOK_MAX_ATTEMPTS`.
    Failed,
    /// `webhook_lost`: never sent.
    Lost,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Scheduled => "scheduled",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
            DeliveryStatus::Lost => "lost",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "scheduled" => Some(DeliveryStatus::Scheduled),
            "delivered" => Some(DeliveryStatus::Delivered),
            "failed" => Some(DeliveryStatus::Failed),
            "lost" => Some(DeliveryStatus::Lost),
            _ => None,
        }
    }
}

/// An event and its delivery, as `GET /admin/events` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    pub id: String,
    pub charge_id: Uuid,
    #[serde(rename = "type")]
    pub kind: EventType,
    /// The webhook faults that struck it.
    pub faults: Vec<String>,
    pub status: DeliveryStatus,
    /// Held back by `webhook_reorder` (until a later event of its charge was delivered).
    pub held: bool,
    /// Deliveries tried.
    pub attempts: i32,
    /// POSTs made, duplicates included.
    pub sends: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The last attempt's HTTP status or transport error.
    pub last_response: Option<String>,
    pub created_at: DateTime<Utc>,
    pub delivered_at: Option<DateTime<Utc>>,
    /// The exact body sent.
    pub body: serde_json::Value,
}

/// The header carrying a webhook's signature: `t=<unix seconds>,v1=<hex HMAC-SHA256>`.
pub const SIGNATURE_HEADER: &str = "provider-signature";

/// The header that marks an answer replayed for a repeated Idempotency-Key.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The request header carrying the caller's idempotency key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
