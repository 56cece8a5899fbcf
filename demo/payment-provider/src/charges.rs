//! `POST /charges`, `GET /charges/{id}`, `GET /charges?reference=`: charging with an optional
//! Idempotency-Key, and the faults drawn for every charge request.
//!
//! Order for one `POST /charges`: validate; draw the faults; `slow` waits; `error_before_charge`
//! answers 503 (nothing stored); otherwise one `INSERT ... ON CONFLICT (idempotency_key) DO
//! NOTHING` commits the charge (`declined` if `decline` struck) or finds the key's earlier charge
//! (same body: replayed; other body: 422). Then `reset_after_charge` resets the connection, or
//! `timeout_after_charge` holds the answer back. The after-charge faults strike replays too: the
//! network does not care whether the charge is new.
//!
//! In async mode ([`crate::mode`]) the charge is stored `pending` with its planned outcome
//! (`declined` if `decline` struck) and `decide_at`, and answered 202; the decider
//! ([`crate::webhooks::decider`]) applies the outcome later and the event reports it. A replay
//! answers the charge as it is now: 202 while pending, then 201 or 402.

use crate::api::{Charge, ChargeRequest, ChargeStatus, IDEMPOTENCY_KEY_HEADER, REPLAYED_HEADER};
use crate::connection::AbortConnection;
use crate::error::{ApiError, Body};
use crate::faults::{FaultMode, Strikes};
use crate::internal_events::{self, ChargeOutcome};
use crate::mode::ConfirmationMode;
use crate::state::AppState;
use crate::webhooks::events::later;
use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

/// A row of `provider.charges`.
#[derive(Debug, sqlx::FromRow)]
pub struct ChargeRow {
    pub id: Uuid,
    pub reference: String,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub refunded_at: Option<DateTime<Utc>>,
}

impl ChargeRow {
    pub fn into_charge(self) -> Result<Charge, ApiError> {
        let status = ChargeStatus::parse(&self.status).ok_or_else(|| {
            ApiError::Corrupt(format!("charge {} has status {:?}", self.id, self.status))
        })?;
        Ok(Charge {
            id: self.id,
            reference: self.reference,
            amount: self.amount,
            currency: self.currency,
            status,
            created_at: self.created_at,
            refunded_at: self.refunded_at,
        })
    }
}

/// Validates a charge request: the same rules as the table's CHECKs, with messages.
pub fn validate(req: &ChargeRequest) -> Result<(), ApiError> {
    if req.amount <= 0 {
        return Err(ApiError::BadRequest(
            "amount must be a positive whole number of minor units".into(),
        ));
    }
    if req.currency.len() != 3 || !req.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(ApiError::BadRequest(
            "currency must be an ISO 4217 code of three capital letters".into(),
        ));
    }
    let n = req.reference.chars().count();
    if n == 0 || n > 200 || req.reference.chars().any(char::is_control) {
        return Err(ApiError::BadRequest(
            "reference must be 1-200 characters without control characters".into(),
        ));
    }
    Ok(())
}

/// The Idempotency-Key header, if any: 1-255 visible ASCII characters.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY_HEADER).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::BadRequest(
            "Idempotency-Key must be given once".into(),
        ));
    }
    let key = value
        .to_str()
        .ok()
        .filter(|k| !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| {
            ApiError::BadRequest("Idempotency-Key must be 1-255 visible ASCII characters".into())
        })?;
    Ok(Some(key.to_string()))
}

/// `POST /charges`.
pub async fn create(
    State(state): State<AppState>,
    Extension(abort): Extension<AbortConnection>,
    headers: HeaderMap,
    Body(req): Body<ChargeRequest>,
) -> Result<Response, ApiError> {
    validate(&req)?;
    let key = idempotency_key(&headers)?.filter(|_| state.idempotency);
    let strikes = state.faults.draw();
    if strikes.has(FaultMode::Slow) {
        internal_events::fault_injected(FaultMode::Slow, &req.reference);
        state.pause(state.slow_delay).await;
    }
    if strikes.has(FaultMode::ErrorBeforeCharge) {
        internal_events::fault_injected(FaultMode::ErrorBeforeCharge, &req.reference);
        internal_events::charge(ChargeOutcome::Unavailable);
        return Err(ApiError::Unavailable);
    }
    let outcome = if strikes.has(FaultMode::Decline) {
        ChargeStatus::Declined
    } else {
        ChargeStatus::Succeeded
    };
    let (row, replayed) = store_or_find(&state, &req, key.as_deref(), outcome).await?;
    let charge = row.into_charge()?;
    internal_events::charge(match (replayed, charge.status) {
        (true, _) => ChargeOutcome::Replayed,
        (false, ChargeStatus::Declined) => ChargeOutcome::Declined,
        (false, ChargeStatus::Pending) => ChargeOutcome::Pending,
        (false, _) => ChargeOutcome::Succeeded,
    });
    after_charge_faults(&state, &strikes, &abort, &req.reference).await;
    Ok(charge_response(&charge, replayed))
}

/// Commits the charge with `outcome` (or `pending` with it planned, in async mode), or finds the
/// key's earlier charge: one `INSERT ... ON CONFLICT (idempotency_key) DO NOTHING`. Returns the
/// row and whether it is a replay; an earlier charge with another body is a key mismatch.
async fn store_or_find(
    state: &AppState,
    req: &ChargeRequest,
    key: Option<&str>,
    outcome: ChargeStatus,
) -> Result<(ChargeRow, bool), ApiError> {
    let mode = state.mode.get();
    let (status, planned, decide_at) = match mode {
        ConfirmationMode::Sync => (outcome, None, None),
        ConfirmationMode::Async => (
            ChargeStatus::Pending,
            Some(outcome.as_str()),
            Some(later(Utc::now(), state.webhooks.confirm_delay)),
        ),
    };
    let inserted: Option<ChargeRow> = sqlx::query_as(
        "INSERT INTO provider.charges
                (id, reference, amount, currency, status, idempotency_key, confirmation, planned_status, decide_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (idempotency_key) DO NOTHING
         RETURNING id, reference, amount, currency, status, idempotency_key, created_at, refunded_at",
    )
    .bind(Uuid::now_v7())
    .bind(&req.reference)
    .bind(req.amount)
    .bind(&req.currency)
    .bind(status.as_str())
    .bind(key)
    .bind(mode.as_str())
    .bind(planned)
    .bind(decide_at)
    .fetch_optional(&state.pool)
    .await?;
    if let Some(row) = inserted {
        if outcome == ChargeStatus::Declined {
            internal_events::fault_injected(FaultMode::Decline, &req.reference);
        }
        return Ok((row, false));
    }
    // The key's charge exists (the unique index made this insert wait for its commit).
    let row: ChargeRow = sqlx::query_as(
        "SELECT id, reference, amount, currency, status, idempotency_key, created_at, refunded_at
           FROM provider.charges WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_one(&state.pool)
    .await?;
    if row.reference != req.reference || row.amount != req.amount || row.currency != req.currency {
        internal_events::charge(ChargeOutcome::KeyMismatch);
        return Err(ApiError::KeyMismatch);
    }
    Ok((row, true))
}

/// The faults that strike once the charge is committed (replays too: the network does not care
/// whether the charge is new): `reset_after_charge` resets the connection and never answers,
/// `timeout_after_charge` holds the answer back.
async fn after_charge_faults(
    state: &AppState,
    strikes: &Strikes,
    abort: &AbortConnection,
    reference: &str,
) {
    if strikes.has(FaultMode::ResetAfterCharge) {
        internal_events::fault_injected(FaultMode::ResetAfterCharge, reference);
        abort.reset();
        // The connection task drops this request with its connection; never answer.
        std::future::pending::<()>().await;
    }
    if strikes.has(FaultMode::TimeoutAfterCharge) {
        internal_events::fault_injected(FaultMode::TimeoutAfterCharge, reference);
        state.pause(state.timeout_delay).await;
    }
}

/// The answer for a charge: 402 when declined, 202 while pending, 201 otherwise (with its
/// `Location`); a replay says so in its header.
fn charge_response(charge: &Charge, replayed: bool) -> Response {
    let mut response = match charge.status {
        ChargeStatus::Declined => ApiError::Declined {
            charge_id: charge.id,
        }
        .into_response(),
        status => {
            let code = if status == ChargeStatus::Pending {
                StatusCode::ACCEPTED
            } else {
                StatusCode::CREATED
            };
            let mut r = (code, Json(charge)).into_response();
            if let Ok(v) = HeaderValue::from_str(&format!("/charges/{}", charge.id)) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
    };
    if replayed {
        response
            .headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

/// `GET /charges/{id}`.
pub async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Charge>, ApiError> {
    let id = Uuid::parse_str(&id)
        .map_err(|_| ApiError::BadRequest("the charge id must be a UUID".into()))?;
    let row: Option<ChargeRow> = sqlx::query_as(
        "SELECT id, reference, amount, currency, status, idempotency_key, created_at, refunded_at
           FROM provider.charges WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&state.pool)
    .await?;
    match row {
        Some(row) => Ok(Json(row.into_charge()?)),
        None => Err(ApiError::NotFound(format!("no charge {id}"))),
    }
}

#[derive(Debug, Deserialize)]
pub struct ByReference {
    reference: Option<String>,
}

/// `GET /charges?reference=...`: every charge of that reference, oldest first (several only when
/// the caller charged again without a key, or with PROVIDER_IDEMPOTENCY=off).
pub async fn by_reference(
    State(state): State<AppState>,
    query: Result<Query<ByReference>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<Charge>>, ApiError> {
    if !state.status_query {
        return Err(ApiError::NotImplemented(
            "lookup by reference is switched off (PROVIDER_STATUS_QUERY=off)".into(),
        ));
    }
    let Query(q) = query?;
    let reference = q
        .reference
        .filter(|r| !r.is_empty())
        .ok_or_else(|| ApiError::BadRequest("the query parameter reference is required".into()))?;
    let rows: Vec<ChargeRow> = sqlx::query_as(
        "SELECT id, reference, amount, currency, status, idempotency_key, created_at, refunded_at
           FROM provider.charges WHERE reference = $1 ORDER BY created_at, id",
    )
    .bind(&reference)
    .fetch_all(&state.pool)
    .await?;
    rows.into_iter()
        .map(ChargeRow::into_charge)
        .collect::<Result<_, _>>()
        .map(Json)
}
