//! [`Idempotency::lookup`]: what an operator may see of the records of one key (status and times,
//! never the request's fingerprint nor the stored response body), so a tool such as the console
//! reads this crate's table through this crate instead of its own SQL.

use crate::key::hash_key;
use crate::store::Idempotency;
use chrono::{DateTime, Utc};
use uuid::Uuid;

/// One record of a key, without its bodies.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct RecordSummary {
    /// The operation (route) the key was used for.
    pub operation: String,
    /// `processing`, `completed`, ... (see [`crate::RecordStatus`]).
    pub status: String,
    pub response_status: Option<i16>,
    pub resource_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub lease_expires_at: Option<DateTime<Utc>>,
}

impl Idempotency {
    /// The records of `key` (as sent; only its hash is compared) in `scope`, one per operation,
    /// oldest first. Expired records not yet purged are included: they say when they expired.
    pub async fn lookup(&self, scope: &str, key: &str) -> Result<Vec<RecordSummary>, sqlx::Error> {
        sqlx::query_as::<_, RecordSummary>(self.schema.sql(
            "SELECT operation, status, response_status, resource_id, created_at, updated_at, \
                    expires_at, lease_expires_at \
             FROM {{schema}}.idempotency_keys WHERE scope = $1 AND key_hash = $2 ORDER BY created_at",
        ))
        .bind(scope)
        .bind(hash_key(key).0.to_vec())
        .fetch_all(&self.pool)
        .await
    }
}
