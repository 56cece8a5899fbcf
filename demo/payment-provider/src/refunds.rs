//! `POST /refunds`: gives a succeeded charge back, whole, once. A second refund of the same
//! charge answers the first (200 with `Idempotent-Replayed: true`), so a retried refund is safe
//! without a key. Refunding a charge made in async mode records a `charge.refunded` event in the
//! refund's transaction.

use crate::api::{ChargeStatus, EventType, REPLAYED_HEADER, Refund, RefundRequest};
use crate::charges::ChargeRow;
use crate::error::{ApiError, Body};
use crate::internal_events;
use crate::mode::ConfirmationMode;
use crate::state::AppState;
use crate::webhooks::events;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use uuid::Uuid;

#[derive(Debug, sqlx::FromRow)]
struct RefundRow {
    id: Uuid,
    charge_id: Uuid,
    amount: i64,
    created_at: DateTime<Utc>,
}

impl From<RefundRow> for Refund {
    fn from(r: RefundRow) -> Self {
        Refund {
            id: r.id,
            charge_id: r.charge_id,
            amount: r.amount,
            created_at: r.created_at,
        }
    }
}

/// `POST /refunds`.
pub async fn create(
    State(state): State<AppState>,
    Body(req): Body<RefundRequest>,
) -> Result<Response, ApiError> {
    let mut tx = state.pool.begin().await?;
    let charge: Option<ChargeRow> = sqlx::query_as(
        "SELECT id, reference, amount, currency, status, idempotency_key, created_at, refunded_at
           FROM provider.charges WHERE id = $1 FOR UPDATE",
    )
    .bind(req.charge_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(charge) = charge else {
        internal_events::refund("not_found");
        return Err(ApiError::NotFound(format!("no charge {}", req.charge_id)));
    };
    match charge.status.as_str() {
        "succeeded" => {}
        "refunded" => {
            let existing: RefundRow = sqlx::query_as(
                "SELECT id, charge_id, amount, created_at FROM provider.refunds WHERE charge_id = $1",
            )
            .bind(charge.id)
            .fetch_one(&mut *tx)
            .await?;
            tx.commit().await?;
            internal_events::refund("replayed");
            let mut r = (StatusCode::OK, Json(Refund::from(existing))).into_response();
            r.headers_mut()
                .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
            return Ok(r);
        }
        other => {
            internal_events::refund("not_refundable");
            return Err(ApiError::Conflict(format!(
                "charge {} is {other}: only a succeeded charge can be refunded",
                charge.id
            )));
        }
    }
    let refund: RefundRow = sqlx::query_as(
        "INSERT INTO provider.refunds (id, charge_id, amount) VALUES ($1, $2, $3)
         RETURNING id, charge_id, amount, created_at",
    )
    .bind(Uuid::now_v7())
    .bind(charge.id)
    .bind(charge.amount)
    .fetch_one(&mut *tx)
    .await?;
    let confirmation: String = sqlx::query_scalar(
        "UPDATE provider.charges SET status = 'refunded', refunded_at = $2 WHERE id = $1
         RETURNING confirmation",
    )
    .bind(charge.id)
    .bind(refund.created_at)
    .fetch_one(&mut *tx)
    .await?;
    if confirmation == ConfirmationMode::Async.as_str() {
        let refunded = ChargeRow {
            status: ChargeStatus::Refunded.as_str().to_owned(),
            refunded_at: Some(refund.created_at),
            ..charge
        }
        .into_charge()?;
        let strikes = state.faults.draw();
        events::record(
            &mut tx,
            &refunded,
            EventType::ChargeRefunded,
            strikes,
            &state.webhooks,
        )
        .await?;
    }
    tx.commit().await?;
    internal_events::refund("refunded");
    Ok((StatusCode::CREATED, Json(Refund::from(refund))).into_response())
}
