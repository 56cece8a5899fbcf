//! The API's request and answer bodies and query strings that belong to no target: what a client
//! sends and gets, with their OpenAPI schemas.

use crate::targets::{dead_letters, outbox_dead};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

#[derive(Debug, Deserialize, IntoParams)]
pub struct Limit {
    /// At most this many (default 100).
    pub limit: Option<i64>,
    /// The `next` of the previous page.
    pub after: Option<String>,
}

/// Body of a single requeue.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RequeueOne {
    pub reason: String,
    /// The row version seen (`version` of the listing).
    pub version: i64,
}

/// Body of a bulk requeue.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RequeueMany {
    pub reason: String,
    /// The rows ticked, with the versions seen (empty with `all`).
    #[serde(default)]
    pub items: Vec<outbox_dead::Item>,
    /// "Select all that match": every dead row, frozen with its version when the request is
    /// made (at most 1,000); the dry run says how many.
    #[serde(default)]
    pub all: bool,
    /// Only say what each would do.
    #[serde(default)]
    pub dry_run: bool,
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct ConsumerQuery {
    /// The consumer's name (its queue; dead letters are in `<name>.dlq`).
    pub consumer: String,
    /// Page size, 1 to 500 (default 100).
    pub limit: Option<usize>,
    /// The `next` of the previous page.
    pub after: Option<String>,
}

/// Body of a replay.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Replay {
    pub reason: String,
    /// The letters ticked, with the versions seen (empty with `all`).
    #[serde(default)]
    pub items: Vec<dead_letters::Item>,
    /// "Select all that match": every letter in the queue, frozen with its version when the
    /// request is made (at most 1,000); the dry run says how many.
    #[serde(default)]
    pub all: bool,
    #[serde(default)]
    pub dry_run: bool,
}

/// Body of an idempotency lookup: a POST, so the key never travels in a URL (logs, history).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct IdempotencyQuery {
    /// The key's scope (tenant, account).
    pub scope: String,
    /// The Idempotency-Key value (hashed before the lookup, never stored).
    pub key: String,
}

/// An idempotency record's status and times (never bodies).
#[derive(Debug, Serialize, ToSchema)]
pub struct IdempotencyRecord {
    pub operation: String,
    pub status: String,
    pub response_status: Option<i16>,
    pub resource_id: Option<Uuid>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub updated_at: chrono::DateTime<chrono::Utc>,
    pub expires_at: chrono::DateTime<chrono::Utc>,
    pub lease_expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Body of actions that only need a reason.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReasonOnly {
    pub reason: String,
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct StatusQuery {
    /// pending, approved, rejected.
    pub status: Option<String>,
}
