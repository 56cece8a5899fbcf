//! `POST /payments` (idempotent, asynchronous: records the payment as `pending` and emits
//! `payment.requested`; the charge happens downstream) and `GET /payments/{id}` (tenant-scoped).

use crate::auth::Tenant;
use crate::error::{ApiError, ErrorBody, FieldError, ValidationErrorBody};
use crate::idempotency::{self, EffectCtx, Operation, RecordStatus, StoredResponse};
use crate::orders::{PositiveInteger, parse_id};
use crate::state::{AppState, Stage};
use crate::{trace_context, validation};
use axum::Extension;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use shared::NewMessage;
use tracing::Instrument;
use utoipa::ToSchema;
use uuid::Uuid;

/// Body of `POST /payments`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreatePaymentRequest {
    /// An order of the caller's tenant.
    pub order_id: Uuid,
    /// Minor units, > 0: a JSON integer or a string of digits.
    pub amount: PositiveInteger,
    /// Three upper-case letters; must equal the order's currency.
    #[schema(example = "EUR", pattern = "^[A-Z]{3}$")]
    pub currency: String,
}

/// A payment as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, sqlx::FromRow)]
pub struct Payment {
    pub id: Uuid,
    pub order_id: Uuid,
    /// Minor units.
    pub amount: i64,
    pub currency: String,
    /// `pending` until the downstream charge sets `succeeded` or `failed`.
    #[schema(example = "pending")]
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Response of `POST /payments`: the accepted payment, and whether this response is a replay.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PaymentAccepted {
    #[serde(flatten)]
    pub payment: Payment,
    /// `false` on the first response, `true` when replayed for a retry with the same key.
    pub replayed: bool,
}

/// Requests a payment of an order. Answers 202: the charge happens downstream; follow `Location`.
#[utoipa::path(
    post,
    path = "/payments",
    tag = "payments",
    request_body = CreatePaymentRequest,
    params(
        ("Idempotency-Key" = String, Header, description = "1-255 printable ASCII characters naming this intent; retries reuse it"),
        ("traceparent" = Option<String>, Header, description = "W3C trace context to continue"),
    ),
    responses(
        (status = 202, description = "Payment accepted, status pending (or the replay of it)", body = PaymentAccepted,
         headers(("Location" = String, description = "/payments/{id}"),
                 ("Idempotent-Replayed" = Option<String>, description = "`true` on replays"))),
        (status = 400, description = "Missing or invalid Idempotency-Key, or unreadable JSON", body = ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
        (status = 404, description = "The order does not exist for this tenant (stored and replayed)", body = ErrorBody),
        (status = 409, description = "A request with this key is still processing (see Retry-After)", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 415, description = "Content-Type is not application/json", body = ErrorBody),
        (status = 422, description = "Validation failed or currency differs from the order's (`errors`), or the key was used with another payload (`error`)", body = ValidationErrorBody),
    ),
    security(("api_key" = []))
)]
pub async fn create_payment(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let key = idempotency::key_from_headers(&headers)?;
    let payment = validation::payment(&validation::json_body(&headers, body)?)?;
    let fingerprint = idempotency::fingerprint(Operation::CreatePayment, &payment.normalized());
    let (span, traceparent) = trace_context::request_span(&headers, "create_payment");
    let tenant_name = tenant.0.clone();
    idempotency::execute(
        &state,
        &tenant_name,
        Operation::CreatePayment,
        key,
        fingerprint,
        move |ctx| Box::pin(request(ctx, tenant, payment, traceparent)),
    )
    .instrument(span)
    .await
}

async fn request(
    ctx: EffectCtx,
    tenant: Tenant,
    payment: validation::NewPayment,
    traceparent: String,
) -> Result<StoredResponse, ApiError> {
    let mut tx = ctx.state.pool.begin().await?;
    let order_currency: Option<String> =
        sqlx::query_scalar("SELECT currency FROM demo.orders WHERE id = $1 AND tenant = $2")
            .bind(payment.order_id)
            .bind(&tenant.0)
            .fetch_optional(&mut *tx)
            .await?;

    // Definitive business errors are stored (status failed) and replayed like successes.
    let definitive_error = match order_currency {
        None => Some(ApiError::NotFound("order")),
        Some(currency) if currency != payment.currency => {
            Some(ApiError::Validation(vec![FieldError::new(
                "currency",
                "currency_mismatch",
                format!("must equal the order currency ({currency})"),
            )]))
        }
        Some(_) => None,
    };
    if let Some(error) = definitive_error {
        let stored = StoredResponse {
            status: error.status().as_u16(),
            body: error.body(),
            resource_id: None,
        };
        ctx.finish(&mut tx, RecordStatus::Failed, &stored).await?;
        ctx.hook(Stage::BeforeCommit).await?;
        tx.commit().await?;
        return Ok(stored);
    }

    let id = Uuid::now_v7();
    let accepted = PaymentAccepted {
        payment: Payment {
            id,
            order_id: payment.order_id,
            amount: payment.amount,
            currency: payment.currency.clone(),
            status: "pending".into(),
            created_at: ctx.now,
            updated_at: ctx.now,
        },
        replayed: false,
    };
    let body = serde_json::to_string(&accepted).map_err(|e| ApiError::Internal(e.to_string()))?;
    let stored = StoredResponse {
        status: 202,
        body,
        resource_id: Some(id),
    };
    let event = serde_json::json!({
        "payment_id": id,
        "order_id": payment.order_id,
        "tenant": tenant.0,
        "amount": payment.amount,
        "currency": payment.currency,
        "requested_at": ctx.now,
    });
    let message = NewMessage::new("payment", id.to_string(), "payment.requested", event)
        .with_header("traceparent", traceparent)
        .with_header("tenant", tenant.0.clone());
    tracing::Span::current().record("message_id", tracing::field::display(message.id));

    // The outcome of the charge is not known yet: the record stays `pending` (never purged) until
    // the payment leaves `pending` (trigger in the migration).
    ctx.finish(&mut tx, RecordStatus::Pending, &stored).await?;
    sqlx::query(
        "INSERT INTO demo.payments (id, tenant, order_id, amount, currency, status, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, 'pending', $6, $6)",
    )
    .bind(id)
    .bind(&tenant.0)
    .bind(payment.order_id)
    .bind(payment.amount)
    .bind(&payment.currency)
    .bind(ctx.now)
    .execute(&mut *tx)
    .await?;
    shared::outbox::enqueue(&mut *tx, &message)
        .await
        .map_err(sqlx::Error::from)?;
    ctx.hook(Stage::BeforeCommit).await?;
    tx.commit().await?;
    Ok(stored)
}

/// Reads a payment of the caller's tenant, with its current status.
#[utoipa::path(
    get,
    path = "/payments/{id}",
    tag = "payments",
    params(("id" = Uuid, Path, description = "Payment id")),
    responses(
        (status = 200, description = "The payment", body = Payment),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
        (status = 404, description = "No such payment for this tenant", body = ErrorBody),
    ),
    security(("api_key" = []))
)]
pub async fn get_payment(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<Payment>, ApiError> {
    let id = parse_id(id).ok_or(ApiError::NotFound("payment"))?;
    let payment: Option<Payment> = sqlx::query_as(
        "SELECT id, order_id, amount, currency, status, created_at, updated_at \
         FROM demo.payments WHERE id = $1 AND tenant = $2",
    )
    .bind(id)
    .bind(&tenant.0)
    .fetch_optional(&state.pool)
    .await?;
    payment.map(Json).ok_or(ApiError::NotFound("payment"))
}
