//! The wire types of the provider's HTTP API, shared by the server and [`crate::client`].

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// What became of a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChargeStatus {
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
            ChargeStatus::Succeeded => "succeeded",
            ChargeStatus::Declined => "declined",
            ChargeStatus::Refunded => "refunded",
        }
    }

    /// The status stored in `provider.charges.status`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
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

/// The header that marks an answer replayed for a repeated Idempotency-Key.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// The request header carrying the caller's idempotency key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
