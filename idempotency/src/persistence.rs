//! The records in `{{schema}}.idempotency_keys` (primary key `(scope, operation, key_hash)`) and
//! every statement on them:
//!
//! 1. `reserve` in its own statement, before any effect:
//!    `INSERT ... status 'processing', lease ... ON CONFLICT DO NOTHING`. One row inserted: this
//!    request owns the key. Otherwise the existing record decides: expired → taken over as new;
//!    other fingerprint → 422; processing with a live lease → 409; processing with an expired
//!    lease (its holder died) → taken over; completed, failed or pending → replayed. Takeovers are
//!    compare-and-set `UPDATE`s, so exactly one contender wins, and they skip a row locked by a
//!    holder inside its effect transaction (that holder is alive: 409, never a wait).
//! 2. `lock` opens the effect's transaction: the record row is locked `FOR UPDATE` if this
//!    request's token still holds it, so a holder whose lease was taken over stops there.
//! 3. `complete` writes the final state in that same transaction, fenced by the token again.
//! 4. `release` deletes a reservation whose effect did not commit (fenced by the token), so a
//!    retry runs anew.

use crate::fingerprint::Fingerprints;
use crate::key::KeyHash;
use crate::store::{Idempotency, add};
use chrono::{DateTime, Utc};
use shared::schema::Schema;
use sqlx::postgres::PgArguments;
use sqlx::{PgConnection, PgPool, Postgres};
use std::sync::Arc;
use uuid::Uuid;

/// How often reserve retries when the record it conflicted with vanished or changed under it.
const RESERVE_ATTEMPTS: usize = 4;

/// States of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStatus {
    /// Reserved; the effect has not committed (holds a lease).
    Processing,
    /// A 2xx response is stored.
    Completed,
    /// A definitive 4xx response is stored.
    Failed,
    /// A 2xx response is stored but the downstream outcome is open: never purged until something
    /// (e.g. a trigger on the resource) moves it to `completed`. Needs a resource id.
    Pending,
}

impl RecordStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RecordStatus::Processing => "processing",
            RecordStatus::Completed => "completed",
            RecordStatus::Failed => "failed",
            RecordStatus::Pending => "pending",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "processing" => RecordStatus::Processing,
            "completed" => RecordStatus::Completed,
            "failed" => RecordStatus::Failed,
            "pending" => RecordStatus::Pending,
            _ => return None,
        })
    }
}

/// A response as stored with its record and replayed to retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// Exact body as first sent.
    pub body: String,
    /// The created resource (gives `Location`).
    pub resource_id: Option<Uuid>,
}

/// What a record is keyed by.
#[derive(Debug, Clone)]
pub(crate) struct RecordKey {
    pub schema: Schema,
    pub scope: String,
    pub operation: Arc<str>,
    pub key: KeyHash,
}

impl RecordKey {
    /// `sql`, a `{{schema}}` template whose $1..$3 are this record's scope, operation and key
    /// hash, with those bound.
    fn query<'q>(&'q self, sql: &str) -> sqlx::query::Query<'q, Postgres, PgArguments> {
        sqlx::query(self.schema.sql(sql))
            .bind(&self.scope)
            .bind(&*self.operation)
            .bind(&self.key.0[..])
    }
}

/// How this request came to own a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owned {
    New,
    Expired,
    TakenOver,
}

/// What reserving a key found.
#[derive(Debug)]
pub(crate) enum Reservation {
    /// This request holds the key with its token and runs the effect.
    Owned(Owned),
    /// A stored response to send again.
    Replay(StoredResponse),
    /// Another request holds a live lease on the key.
    InFlight,
    /// The key was used with another payload.
    Mismatch,
}

#[derive(Debug, sqlx::FromRow)]
struct RecordRow {
    fingerprint: Vec<u8>,
    status: String,
    response_status: Option<i16>,
    response_body: Option<String>,
    resource_id: Option<Uuid>,
    lease_token: Option<Uuid>,
    lease_expires_at: Option<DateTime<Utc>>,
    expires_at: DateTime<Utc>,
}

impl RecordRow {
    /// Expired records count as new: final records after their TTL, and reservations whose TTL and
    /// lease have both passed. Pending records wait for their downstream outcome.
    fn is_expired(&self, now: DateTime<Utc>) -> bool {
        self.expires_at <= now
            && match RecordStatus::parse(&self.status) {
                Some(RecordStatus::Completed | RecordStatus::Failed) => true,
                Some(RecordStatus::Processing) => self.lease_expires_at.is_some_and(|l| l <= now),
                Some(RecordStatus::Pending) | None => false,
            }
    }
}

/// Reserves `record` for a request with `fingerprints` under the fencing `token` (fresh per
/// request), or tells what the existing record says.
pub(crate) async fn reserve(
    store: &Idempotency,
    record: &RecordKey,
    fingerprints: &Fingerprints,
    token: Uuid,
    now: DateTime<Utc>,
) -> Result<Reservation, sqlx::Error> {
    let r = Reserving {
        pool: &store.pool,
        record,
        fingerprint: &fingerprints.current[..],
        token,
        now,
        lease_until: add(now, store.lease),
        expires_at: add(now, store.ttl),
    };
    for _ in 0..RESERVE_ATTEMPTS {
        if r.insert().await? {
            return Ok(Reservation::Owned(Owned::New));
        }
        // Released or purged since our insert conflicted: try to insert again.
        let Some(row) = r.read().await? else { continue };
        if row.is_expired(now) {
            if r.take_expired().await? {
                return Ok(Reservation::Owned(Owned::Expired));
            }
            continue;
        }
        if !fingerprints.matches(&row.fingerprint) {
            return Ok(Reservation::Mismatch);
        }
        match RecordStatus::parse(&row.status) {
            Some(RecordStatus::Processing) => {
                let lease_expired = row.lease_expires_at.is_some_and(|l| l <= now);
                if !lease_expired {
                    return Ok(Reservation::InFlight);
                }
                if r.take_over(row.lease_token).await? {
                    return Ok(Reservation::Owned(Owned::TakenOver));
                }
                continue;
            }
            Some(RecordStatus::Completed | RecordStatus::Failed | RecordStatus::Pending) => {
                if let (Some(status), Some(body)) = (row.response_status, row.response_body) {
                    return Ok(Reservation::Replay(StoredResponse {
                        status: u16::try_from(status).unwrap_or(500),
                        body,
                        resource_id: row.resource_id,
                    }));
                }
                tracing::error!(key = %record.key.log_id(), "final idempotency record without a response");
                return Ok(Reservation::InFlight);
            }
            None => {
                tracing::error!(key = %record.key.log_id(), status = %row.status, "unknown idempotency record status");
                return Ok(Reservation::InFlight);
            }
        }
    }
    // The record kept changing under us: the client may retry shortly.
    Ok(Reservation::InFlight)
}

/// One request's reservation of a record: its fingerprint, its token and the times it sets.
struct Reserving<'a> {
    pool: &'a PgPool,
    record: &'a RecordKey,
    fingerprint: &'a [u8],
    token: Uuid,
    now: DateTime<Utc>,
    lease_until: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

impl Reserving<'_> {
    /// Inserts the record as ours, if there is none.
    async fn insert(&self) -> Result<bool, sqlx::Error> {
        self.write_ours(
            "INSERT INTO {{schema}}.idempotency_keys \
                 (scope, operation, key_hash, fingerprint, status, lease_token, lease_expires_at, \
                  created_at, updated_at, expires_at) \
             VALUES ($1, $2, $3, $4, 'processing', $5, $6, $7, $7, $8) \
             ON CONFLICT (scope, operation, key_hash) DO NOTHING",
        )
        .await
    }

    /// The record as it is.
    async fn read(&self) -> Result<Option<RecordRow>, sqlx::Error> {
        let record = self.record;
        sqlx::query_as(record.schema.sql(
            "SELECT fingerprint, status, response_status, response_body, resource_id, lease_token, \
                    lease_expires_at, expires_at \
             FROM {{schema}}.idempotency_keys WHERE scope = $1 AND operation = $2 AND key_hash = $3",
        ))
        .bind(&record.scope)
        .bind(&*record.operation)
        .bind(&record.key.0[..])
        .fetch_optional(self.pool)
        .await
    }

    /// Takes an expired record over as a new one (unless another request just did).
    async fn take_expired(&self) -> Result<bool, sqlx::Error> {
        self.write_ours(
            "UPDATE {{schema}}.idempotency_keys SET status = 'processing', fingerprint = $4, \
                    lease_token = $5, lease_expires_at = $6, response_status = NULL, \
                    response_body = NULL, resource_id = NULL, created_at = $7, updated_at = $7, \
                    expires_at = $8 \
             WHERE (scope, operation, key_hash) IN ( \
                 SELECT scope, operation, key_hash FROM {{schema}}.idempotency_keys \
                  WHERE scope = $1 AND operation = $2 AND key_hash = $3 AND expires_at <= $7 \
                    AND (status IN ('completed', 'failed') \
                         OR (status = 'processing' AND lease_expires_at <= $7)) \
                    FOR UPDATE SKIP LOCKED)",
        )
        .await
    }

    /// Runs `sql` (a template whose $1..$8 are scope, operation, key hash, fingerprint, lease
    /// token, lease end, now and expiry) to write the record as ours; whether it did.
    async fn write_ours(&self, sql: &str) -> Result<bool, sqlx::Error> {
        let record = self.record;
        Ok(record
            .query(sql)
            .bind(self.fingerprint)
            .bind(self.token)
            .bind(self.lease_until)
            .bind(self.now)
            .bind(self.expires_at)
            .execute(self.pool)
            .await?
            .rows_affected()
            == 1)
    }

    /// Takes over a reservation whose lease expired: the holder died, or has not begun its
    /// effect. Compare-and-set on the token we saw (`seen`). A holder inside its effect
    /// transaction holds the row lock: it is alive, so the row is skipped (not waited for) and
    /// this request answers 409.
    async fn take_over(&self, seen: Option<Uuid>) -> Result<bool, sqlx::Error> {
        let record = self.record;
        Ok(record
            .query(
                "UPDATE {{schema}}.idempotency_keys \
                 SET lease_token = $5, lease_expires_at = $6, updated_at = $7 \
                 WHERE (scope, operation, key_hash) IN ( \
                     SELECT scope, operation, key_hash FROM {{schema}}.idempotency_keys \
                      WHERE scope = $1 AND operation = $2 AND key_hash = $3 \
                        AND status = 'processing' AND lease_token = $4 \
                        FOR UPDATE SKIP LOCKED)",
            )
            .bind(seen)
            .bind(self.token)
            .bind(self.lease_until)
            .bind(self.now)
            .execute(self.pool)
            .await?
            .rows_affected()
            == 1)
    }
}

/// Locks the record inside the effect's transaction if `token` still holds it. Returns false when
/// the lease was taken over: the caller must roll back.
pub(crate) async fn lock(
    conn: &mut PgConnection,
    record: &RecordKey,
    token: Uuid,
) -> Result<bool, sqlx::Error> {
    let held: Option<i32> = sqlx::query_scalar(record.schema.sql(
        "SELECT 1 FROM {{schema}}.idempotency_keys \
         WHERE scope = $1 AND operation = $2 AND key_hash = $3 \
           AND status = 'processing' AND lease_token = $4 \
         FOR UPDATE",
    ))
    .bind(&record.scope)
    .bind(&*record.operation)
    .bind(&record.key.0[..])
    .bind(token)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(held.is_some())
}

/// Writes the final state of a record inside the effect's transaction, if `token` still holds it.
/// Returns false when the lease was taken over: the caller must roll back.
pub(crate) async fn complete(
    conn: &mut PgConnection,
    record: &RecordKey,
    token: Uuid,
    status: RecordStatus,
    response: &StoredResponse,
    now: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    let status_code = i16::try_from(response.status).unwrap_or(500);
    let done = record
        .query(
            "UPDATE {{schema}}.idempotency_keys SET status = $5, response_status = $6, \
                    response_body = $7, resource_id = $8, lease_token = NULL, lease_expires_at = NULL, \
                    updated_at = $9 \
             WHERE scope = $1 AND operation = $2 AND key_hash = $3 \
               AND status = 'processing' AND lease_token = $4",
        )
        .bind(token)
        .bind(status.as_str())
        .bind(status_code)
        .bind(&response.body)
        .bind(response.resource_id)
        .bind(now)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    Ok(done == 1)
}

/// Deletes a reservation this request still holds (no effect committed), so a retry runs anew.
pub(crate) async fn release(
    pool: &PgPool,
    record: &RecordKey,
    token: Uuid,
) -> Result<bool, sqlx::Error> {
    let n = record
        .query(
            "DELETE FROM {{schema}}.idempotency_keys \
             WHERE scope = $1 AND operation = $2 AND key_hash = $3 \
               AND status = 'processing' AND lease_token = $4",
        )
        .bind(token)
        .execute(pool)
        .await?
        .rows_affected();
    Ok(n == 1)
}
