//! Idempotency keys: validate, fingerprint, reserve before the effect, complete with the effect,
//! release on failure, replay, expire and purge.
//!
//! The life of a record (table `idempotency_keys`, primary key `(tenant, operation, key_hash)`):
//!
//! 1. **Reserve** in its own statement, before any effect:
//!    `INSERT ... status 'processing', lease ... ON CONFLICT DO NOTHING`. One row inserted: this
//!    request owns the key. Otherwise the existing record decides: expired → taken over as new;
//!    other fingerprint → 422; processing with a live lease → 409 + `Retry-After`; processing with
//!    an expired lease (its holder died) → taken over; completed, failed or pending → replayed.
//!    Takeovers are compare-and-set `UPDATE`s, so exactly one contender wins.
//! 2. **Effect** in one short transaction: the fenced completion of the record (`WHERE
//!    lease_token = ours`, so a holder whose lease was taken over cannot complete) plus the
//!    business rows plus the outbox event. Nothing is held open across anything slow.
//! 3. **Release** when the effect did not commit (error, panic, dropped request): the processing
//!    row is deleted (again fenced by the token), so a retry runs anew.
//! 4. **Purge**: completed and failed records past `expires_at`, and reservations abandoned for
//!    longer than the TTL, are deleted in bounded batches. Pending and live processing records stay.

use crate::config::Settings;
use crate::error::ApiError;
use crate::internal_events::{self, Outcome, ReleaseReason};
use crate::state::{AppState, Stage, add, sub};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;
use sha2::{Digest, Sha256};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use std::panic::AssertUnwindSafe;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Request header carrying the key.
pub const KEY_HEADER: &str = "idempotency-key";
/// Response header set on replays.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Longest accepted key.
pub const MAX_KEY_LEN: usize = 255;
/// Version of the fingerprint input; bump it when the canonical form changes.
pub const FINGERPRINT_VERSION: u32 = 1;

/// How often reserve retries when the record it conflicted with vanished or changed under it.
const RESERVE_ATTEMPTS: usize = 4;

/// The idempotent operations; with the tenant they scope a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    CreateOrder,
    CreatePayment,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::CreateOrder => "create_order",
            Operation::CreatePayment => "create_payment",
        }
    }

    /// The URL of a resource this operation created.
    pub fn location(self, id: Uuid) -> String {
        match self {
            Operation::CreateOrder => format!("/orders/{id}"),
            Operation::CreatePayment => format!("/payments/{id}"),
        }
    }
}

/// The SHA-256 of a validated key: all the producer keeps of it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyHash(pub [u8; 32]);

impl std::fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyHash({}…)", hex::encode(&self.0[..6]))
    }
}

impl KeyHash {
    /// A short, non-reversible id for logs.
    pub fn log_id(&self) -> String {
        hex::encode(&self.0[..6])
    }
}

/// SHA-256 of a key as sent.
pub fn hash_key(key: &str) -> KeyHash {
    KeyHash(Sha256::digest(key.as_bytes()).into())
}

/// Checks a raw key: 1 to 255 printable ASCII characters (0x20-0x7E), not only spaces.
pub fn validate_key(raw: &[u8]) -> Result<&str, ApiError> {
    if raw.iter().all(|b| *b == b' ' || *b == b'\t') {
        return Err(ApiError::BadRequest(
            "Idempotency-Key must not be empty".into(),
        ));
    }
    if raw.len() > MAX_KEY_LEN {
        return Err(ApiError::BadRequest(format!(
            "Idempotency-Key must be at most {MAX_KEY_LEN} characters"
        )));
    }
    if !raw.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return Err(ApiError::BadRequest(
            "Idempotency-Key must consist of printable ASCII characters".into(),
        ));
    }
    std::str::from_utf8(raw)
        .map_err(|_| ApiError::BadRequest("Idempotency-Key must be ASCII".into()))
}

/// The key of a request: exactly one valid `Idempotency-Key` header, hashed.
pub fn key_from_headers(headers: &HeaderMap) -> Result<KeyHash, ApiError> {
    let mut values = headers.get_all(KEY_HEADER).iter();
    let Some(value) = values.next() else {
        return Err(ApiError::BadRequest(
            "Idempotency-Key header is required".into(),
        ));
    };
    if values.next().is_some() {
        return Err(ApiError::BadRequest(
            "only one Idempotency-Key header is allowed".into(),
        ));
    }
    validate_key(value.as_bytes()).map(hash_key)
}

/// Canonical JSON: object keys sorted (bytewise), no whitespace, numbers and strings as
/// serde_json writes them. Independent of serde_json's `preserve_order` feature.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// The fingerprint of a request: SHA-256 over the canonical JSON of the operation and the
/// validated, normalized request.
pub fn fingerprint(operation: Operation, normalized_request: &Value) -> [u8; 32] {
    let input = serde_json::json!({
        "v": FINGERPRINT_VERSION,
        "operation": operation.as_str(),
        "request": normalized_request,
    });
    Sha256::digest(canonical_json(&input).as_bytes()).into()
}

/// States of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStatus {
    Processing,
    Completed,
    Failed,
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
    /// Exact JSON body as first sent.
    pub body: String,
    /// The created resource (gives `Location`).
    pub resource_id: Option<Uuid>,
}

/// What a record is keyed by.
#[derive(Debug, Clone)]
pub(crate) struct Scope {
    pub schema: Schema,
    pub tenant: String,
    pub operation: Operation,
    pub key: KeyHash,
}

/// What reserving a key found.
#[derive(Debug)]
pub(crate) enum Reservation {
    /// This request holds the key with its token and runs the effect.
    Owned { outcome: Outcome },
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

/// Reserves `scope` for a request with `fingerprint` under the fencing `token` (fresh per request),
/// or tells what the existing record says.
pub(crate) async fn reserve(
    pool: &PgPool,
    scope: &Scope,
    fingerprint: &[u8; 32],
    token: Uuid,
    now: DateTime<Utc>,
    settings: &Settings,
) -> Result<Reservation, sqlx::Error> {
    let lease_until = add(now, settings.lease);
    let expires_at = add(now, settings.idempotency_ttl);
    for _ in 0..RESERVE_ATTEMPTS {
        let inserted = sqlx::query(scope.schema.sql(
            "INSERT INTO {{schema}}.idempotency_keys \
                 (scope, operation, key_hash, fingerprint, status, lease_token, lease_expires_at, \
                  created_at, updated_at, expires_at) \
             VALUES ($1, $2, $3, $4, 'processing', $5, $6, $7, $7, $8) \
             ON CONFLICT (scope, operation, key_hash) DO NOTHING",
        ))
        .bind(&scope.tenant)
        .bind(scope.operation.as_str())
        .bind(&scope.key.0[..])
        .bind(&fingerprint[..])
        .bind(token)
        .bind(lease_until)
        .bind(now)
        .bind(expires_at)
        .execute(pool)
        .await?
        .rows_affected()
            == 1;
        if inserted {
            return Ok(Reservation::Owned {
                outcome: Outcome::New,
            });
        }

        let row: Option<RecordRow> = sqlx::query_as(
            scope.schema.sql("SELECT fingerprint, status, response_status, response_body, resource_id, lease_token, \
                    lease_expires_at, expires_at \
             FROM {{schema}}.idempotency_keys WHERE scope = $1 AND operation = $2 AND key_hash = $3"),
        )
        .bind(&scope.tenant)
        .bind(scope.operation.as_str())
        .bind(&scope.key.0[..])
        .fetch_optional(pool)
        .await?;
        // Released or purged since our insert conflicted: try to insert again.
        let Some(row) = row else { continue };

        if row.is_expired(now) {
            let taken = sqlx::query(
                scope.schema.sql("UPDATE {{schema}}.idempotency_keys SET status = 'processing', fingerprint = $4, lease_token = $5, \
                        lease_expires_at = $6, response_status = NULL, response_body = NULL, \
                        resource_id = NULL, created_at = $7, updated_at = $7, expires_at = $8 \
                 WHERE scope = $1 AND operation = $2 AND key_hash = $3 AND expires_at <= $7 \
                   AND (status IN ('completed', 'failed') \
                        OR (status = 'processing' AND lease_expires_at <= $7))"),
            )
            .bind(&scope.tenant)
            .bind(scope.operation.as_str())
            .bind(&scope.key.0[..])
            .bind(&fingerprint[..])
            .bind(token)
            .bind(lease_until)
            .bind(now)
            .bind(expires_at)
            .execute(pool)
            .await?
            .rows_affected()
                == 1;
            if taken {
                return Ok(Reservation::Owned {
                    outcome: Outcome::Expired,
                });
            }
            continue;
        }

        if row.fingerprint.as_slice() != fingerprint.as_slice() {
            return Ok(Reservation::Mismatch);
        }

        match RecordStatus::parse(&row.status) {
            Some(RecordStatus::Processing) => {
                let lease_expired = row.lease_expires_at.is_some_and(|l| l <= now);
                if !lease_expired {
                    return Ok(Reservation::InFlight);
                }
                // The holder died (or hangs): compare-and-set on the token we saw.
                let taken = sqlx::query(
                    scope.schema.sql("UPDATE {{schema}}.idempotency_keys SET lease_token = $5, lease_expires_at = $6, updated_at = $7 \
                     WHERE scope = $1 AND operation = $2 AND key_hash = $3 \
                       AND status = 'processing' AND lease_token = $4"),
                )
                .bind(&scope.tenant)
                .bind(scope.operation.as_str())
                .bind(&scope.key.0[..])
                .bind(row.lease_token)
                .bind(token)
                .bind(lease_until)
                .bind(now)
                .execute(pool)
                .await?
                .rows_affected()
                    == 1;
                if taken {
                    return Ok(Reservation::Owned {
                        outcome: Outcome::TakenOver,
                    });
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
                tracing::error!(key = %scope.key.log_id(), "final idempotency record without a response");
                return Ok(Reservation::InFlight);
            }
            None => {
                tracing::error!(key = %scope.key.log_id(), status = %row.status, "unknown idempotency record status");
                return Ok(Reservation::InFlight);
            }
        }
    }
    // The record kept changing under us: the client may retry shortly.
    Ok(Reservation::InFlight)
}

/// Writes the final state of a record inside the effect's transaction, if `token` still holds it.
/// Returns false when the lease was taken over: the caller must roll back.
pub(crate) async fn complete(
    conn: &mut PgConnection,
    scope: &Scope,
    token: Uuid,
    status: RecordStatus,
    response: &StoredResponse,
    now: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    debug_assert!(status != RecordStatus::Processing);
    let status_code = i16::try_from(response.status).unwrap_or(500);
    let done = sqlx::query(
        scope.schema.sql("UPDATE {{schema}}.idempotency_keys SET status = $5, response_status = $6, response_body = $7, \
                resource_id = $8, lease_token = NULL, lease_expires_at = NULL, updated_at = $9 \
         WHERE scope = $1 AND operation = $2 AND key_hash = $3 \
           AND status = 'processing' AND lease_token = $4"),
    )
    .bind(&scope.tenant)
    .bind(scope.operation.as_str())
    .bind(&scope.key.0[..])
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
    scope: &Scope,
    token: Uuid,
) -> Result<bool, sqlx::Error> {
    let n = sqlx::query(
        scope.schema.sql("DELETE FROM {{schema}}.idempotency_keys \
         WHERE scope = $1 AND operation = $2 AND key_hash = $3 AND status = 'processing' AND lease_token = $4"),
    )
    .bind(&scope.tenant)
    .bind(scope.operation.as_str())
    .bind(&scope.key.0[..])
    .bind(token)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// Releases the reservation when dropped armed: covers errors, panics and requests dropped
/// mid-flight (client gone). The delete is fenced by the token and by `status = 'processing'`, so
/// it is harmless after a commit whose acknowledgement was lost.
struct ReleaseGuard {
    pool: PgPool,
    scope: Scope,
    token: Uuid,
    armed: bool,
}

impl ReleaseGuard {
    fn disarm(&mut self) {
        self.armed = false;
    }

    async fn release(mut self, reason: ReleaseReason) {
        self.armed = false;
        release_logged(&self.pool, &self.scope, self.token, reason).await;
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (pool, scope, token) = (self.pool.clone(), self.scope.clone(), self.token);
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    release_logged(&pool, &scope, token, ReleaseReason::Cancelled).await
                });
            }
            Err(_) => {
                tracing::warn!(key = %scope.key.log_id(), "no runtime to release the reservation; its lease will expire")
            }
        }
    }
}

async fn release_logged(pool: &PgPool, scope: &Scope, token: Uuid, reason: ReleaseReason) {
    match release(pool, scope, token).await {
        Ok(true) => {
            internal_events::reservation_released(scope.operation, reason);
            tracing::info!(key = %scope.key.log_id(), operation = scope.operation.as_str(), reason = reason.as_str(),
                "released idempotency reservation without effect");
        }
        Ok(false) => {}
        Err(e) => tracing::warn!(
            key = %scope.key.log_id(),
            error = %plumbing::telemetry::ErrorChain(&e),
            "cannot release idempotency reservation; a retry takes it over once its lease expires"
        ),
    }
}

/// What the effect of a request gets: who it is, the token to complete with, and the time.
pub(crate) struct EffectCtx {
    pub state: AppState,
    pub scope: Scope,
    pub token: Uuid,
    pub now: DateTime<Utc>,
}

impl EffectCtx {
    /// Completes the record inside the effect transaction; `Superseded` if our lease was taken over.
    pub async fn finish(
        &self,
        conn: &mut PgConnection,
        status: RecordStatus,
        response: &StoredResponse,
    ) -> Result<(), ApiError> {
        if complete(conn, &self.scope, self.token, status, response, self.now).await? {
            Ok(())
        } else {
            Err(ApiError::Superseded)
        }
    }

    /// The fault-injection point `stage`.
    pub async fn hook(&self, stage: Stage) -> Result<(), ApiError> {
        Ok(self.state.hook(stage, self.scope.operation).await?)
    }
}

/// Runs an idempotent POST: reserve, then `effect` (which must complete the record through
/// [`EffectCtx::finish`] in its transaction), then the response; or a replay, 409 or 422.
pub(crate) async fn execute<F>(
    state: &AppState,
    tenant: &str,
    operation: Operation,
    key: KeyHash,
    fingerprint: [u8; 32],
    effect: F,
) -> Result<Response, ApiError>
where
    F: FnOnce(EffectCtx) -> BoxFuture<'static, Result<StoredResponse, ApiError>>,
{
    let now = state.now();
    let scope = Scope {
        schema: state.settings.schema.clone(),
        tenant: tenant.to_owned(),
        operation,
        key,
    };
    // Armed before reserving: if this request is dropped while the reservation is in flight, the
    // token-fenced delete removes whatever it reserved (and nothing else).
    let token = Uuid::new_v4();
    let mut guard = ReleaseGuard {
        pool: state.pool.clone(),
        scope: scope.clone(),
        token,
        armed: true,
    };
    let reservation = match reserve(
        &state.pool,
        &scope,
        &fingerprint,
        token,
        now,
        &state.settings,
    )
    .await
    {
        Ok(reservation) => reservation,
        Err(e) => {
            guard.release(ReleaseReason::Error).await;
            return Err(e.into());
        }
    };
    if !matches!(reservation, Reservation::Owned { .. }) {
        guard.disarm();
    }
    let outcome = match reservation {
        Reservation::Replay(stored) => {
            internal_events::idempotency_outcome(operation, Outcome::Replayed);
            return Ok(respond(operation, &stored, true));
        }
        Reservation::InFlight => {
            internal_events::idempotency_outcome(operation, Outcome::Conflict);
            return Err(ApiError::InFlight);
        }
        Reservation::Mismatch => {
            internal_events::idempotency_outcome(operation, Outcome::Mismatch);
            return Err(ApiError::KeyReused);
        }
        Reservation::Owned { outcome } => outcome,
    };
    internal_events::idempotency_outcome(operation, outcome);
    tracing::debug!(key = %key.log_id(), tenant, operation = operation.as_str(), outcome = outcome.as_str(), "key reserved");

    let ctx = EffectCtx {
        state: state.clone(),
        scope,
        token,
        now,
    };
    let work = async move {
        ctx.hook(Stage::Reserved).await?;
        effect(ctx).await
    };
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(Ok(stored)) => {
            guard.disarm();
            Ok(respond(operation, &stored, false))
        }
        Ok(Err(ApiError::Superseded)) => {
            // Another request holds the key now; ours is no longer ours to release.
            guard.disarm();
            internal_events::idempotency_outcome(operation, Outcome::Conflict);
            Err(ApiError::Superseded)
        }
        Ok(Err(e)) => {
            guard.release(ReleaseReason::Error).await;
            Err(e)
        }
        Err(panic) => {
            guard.release(ReleaseReason::Panic).await;
            Err(ApiError::Panicked(panic_message(panic.as_ref())))
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// The replay marker: stored bodies of successful responses end with `"replayed":false}`.
const MARKER_FRESH: &str = "\"replayed\":false}";
const MARKER_REPLAYED: &str = "\"replayed\":true}";

/// The stored body with its replay marker set: byte-identical apart from `false` → `true`. Bodies
/// without a marker (stored errors, which hold only `error` or `errors`) are returned as stored.
pub fn mark_replayed(body: &str) -> String {
    match body.strip_suffix(MARKER_FRESH) {
        Some(prefix) => format!("{prefix}{MARKER_REPLAYED}"),
        None => body.to_owned(),
    }
}

/// The HTTP response for a stored (or just stored) response.
pub(crate) fn respond(operation: Operation, stored: &StoredResponse, replayed: bool) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = if replayed {
        mark_replayed(&stored.body)
    } else {
        stored.body.clone()
    };
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if replayed {
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    if let (true, Some(id)) = (status.is_success(), stored.resource_id)
        && let Ok(location) = HeaderValue::from_str(&operation.location(id))
    {
        headers.insert(header::LOCATION, location);
    }
    response
}

/// Deletes expired records in batches of `batch_size`, at most `max_batches` statements: completed
/// and failed records whose `expires_at` passed, and processing records whose lease ended more than
/// `ttl` ago (abandoned: their effect never committed). Pending records and live reservations stay.
/// Returns how many were deleted.
pub async fn purge_expired(
    pool: &PgPool,
    schema: &Schema,
    now: DateTime<Utc>,
    ttl: Duration,
    batch_size: u32,
    max_batches: u32,
) -> Result<u64, sqlx::Error> {
    let abandoned_before = sub(now, ttl);
    let batch_size = batch_size.max(1);
    let mut total = 0u64;
    for _ in 0..max_batches {
        let n = sqlx::query(schema.sql(
            "WITH doomed AS ( \
                 SELECT scope, operation, key_hash FROM {{schema}}.idempotency_keys \
                 WHERE (status IN ('completed', 'failed') AND expires_at <= $1) \
                    OR (status = 'processing' AND lease_expires_at <= $2) \
                 LIMIT $3 FOR UPDATE SKIP LOCKED) \
             DELETE FROM {{schema}}.idempotency_keys k USING doomed d \
             WHERE k.scope = d.scope AND k.operation = d.operation AND k.key_hash = d.key_hash",
        ))
        .bind(now)
        .bind(abandoned_before)
        .bind(i64::from(batch_size))
        .execute(pool)
        .await?
        .rows_affected();
        total += n;
        if n < u64::from(batch_size) {
            break;
        }
    }
    if total > 0 {
        internal_events::purged(total);
    }
    Ok(total)
}

/// The background purge: every `purge_interval` until `shutdown`.
pub(crate) async fn purge_loop(state: AppState, shutdown: CancellationToken) {
    let Some(interval) = state.settings.purge_interval else {
        return;
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let s = &state.settings;
        match purge_expired(
            &state.pool,
            &s.schema,
            state.now(),
            s.idempotency_ttl,
            s.purge_batch_size,
            s.purge_max_batches,
        )
        .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(purged = n, "purged expired idempotency records"),
            Err(e) => {
                tracing::warn!(error = %plumbing::telemetry::ErrorChain(&e), "purging idempotency records failed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys_and_drops_whitespace() {
        let a: Value =
            serde_json::from_str(r#"{ "b": [1, {"y": 2, "x": "é"}], "a": null }"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a":null,"b":[1,{"x":"é","y":2}]}"#).unwrap();
        assert_eq!(canonical_json(&a), r#"{"a":null,"b":[1,{"x":"é","y":2}]}"#);
        assert_eq!(
            fingerprint(Operation::CreateOrder, &a),
            fingerprint(Operation::CreateOrder, &b)
        );
        assert_ne!(
            fingerprint(Operation::CreateOrder, &a),
            fingerprint(Operation::CreatePayment, &a)
        );
    }

    #[test]
    fn key_rules() {
        assert!(validate_key(b"abc").is_ok());
        assert!(validate_key(b"'; DROP TABLE orders; --").is_ok());
        assert!(validate_key(&[b'k'; 255]).is_ok());
        assert!(validate_key(&[b'k'; 256]).is_err());
        assert!(validate_key(b"").is_err());
        assert!(validate_key(b"   ").is_err());
        assert!(validate_key(b"a\tb").is_err());
        assert!(validate_key("kéy".as_bytes()).is_err());
        assert!(validate_key(b"a\x7fb").is_err());
    }

    #[test]
    fn replay_marker() {
        assert_eq!(
            mark_replayed(r#"{"id":1,"replayed":false}"#),
            r#"{"id":1,"replayed":true}"#
        );
        assert_eq!(
            mark_replayed(r#"{"error":"order not found"}"#),
            r#"{"error":"order not found"}"#
        );
    }
}
