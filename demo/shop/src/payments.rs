//! `POST /payments` (idempotent, asynchronous: records the payment as `pending`, emits
//! `payment.requested` and starts its payment process ([`crate::payment_process`]), all in the
//! request's effect transaction; `producer worker` charges and settles it) and
//! `GET /payments/{id}` (tenant-scoped).

use crate::auth::Tenant;
use crate::error::{ApiError, ErrorBody, FieldError, ValidationErrorBody};
use crate::fault::{Operation, Stage};
use crate::orders::{PositiveInteger, json_response, parse_id};
use crate::state::AppState;
use crate::{idempotent_post, trace_context, validation};
use axum::Extension;
use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use chrono::{DateTime, Utc};
use idempotency::{Effect, IdempotencyLayer, Pending, ResourceId};
use serde::{Deserialize, Serialize};
use shared::NewMessage;
use sqlx::PgConnection;
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
    /// `pending` until the payment process sets `succeeded` or `failed`.
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
    Extension(payment): Extension<validation::NewPayment>,
    effect: Effect,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (span, traceparent) = trace_context::request_span(&headers, "create_payment");
    request(state, effect, tenant, payment, traceparent)
        .instrument(span)
        .await
}

/// The Idempotency-Key layer of `POST /payments`: scoped by tenant, fingerprinted over the
/// validated payment (which the handler gets as an extension).
pub(crate) fn idempotency(state: &AppState) -> IdempotencyLayer {
    idempotent_post::layer(
        state,
        Operation::CreatePayment,
        validation::payment,
        validation::NewPayment::normalized,
    )
}

/// The effect of `POST /payments`: the order checked, then the payment row, its process and its
/// `payment.requested` event in the effect's transaction; answers 202 (the charge is downstream).
async fn request(
    state: AppState,
    effect: Effect,
    tenant: Tenant,
    payment: validation::NewPayment,
    traceparent: String,
) -> Result<Response, ApiError> {
    state
        .hook(Stage::Reserved, Operation::CreatePayment)
        .await?;
    let now = effect.now();
    let mut tx = effect.tx().await?;
    // Definitive business errors (4xx) are stored by the layer (status failed) and replayed like
    // successes.
    if let Some(error) = order_refuses(&mut tx, &tenant, &payment).await? {
        idempotent_post::finish(&state, tx, Operation::CreatePayment).await?;
        return Err(error);
    }

    let id = Uuid::now_v7();
    let accepted = PaymentAccepted {
        payment: Payment {
            id,
            order_id: payment.order_id,
            amount: payment.amount,
            currency: payment.currency.clone(),
            status: "pending".into(),
            created_at: now,
            updated_at: now,
        },
        replayed: false,
    };
    let body = serde_json::to_string(&accepted).map_err(|e| ApiError::Internal(e.to_string()))?;
    let event = serde_json::json!({
        "payment_id": id,
        "order_id": payment.order_id,
        "tenant": tenant.0,
        "amount": payment.amount,
        "currency": payment.currency,
        "requested_at": now,
    });
    let message = NewMessage::new("payment", id.to_string(), "payment.requested", event)
        .with_header("traceparent", traceparent.clone())
        .with_header("tenant", tenant.0.clone());
    tracing::Span::current().record("message_id", tracing::field::display(message.id));

    insert_with_process(&state, &mut tx, &tenant, &payment, id, now, traceparent).await?;
    idempotent_post::enqueue_and_finish(&state, tx, &message, Operation::CreatePayment).await?;
    // The outcome of the charge is not known yet: the record is stored `pending` (never purged)
    // until the payment leaves `pending` (trigger in the demo's migration).
    Ok(json_response(
        StatusCode::ACCEPTED,
        (ResourceId(id), Pending),
        body,
    ))
}

/// Why the order refuses this payment, if it does: it is not the tenant's (404) or its currency
/// differs (422). Both are definitive, so the layer stores and replays them.
async fn order_refuses(
    tx: &mut PgConnection,
    tenant: &Tenant,
    payment: &validation::NewPayment,
) -> Result<Option<ApiError>, ApiError> {
    let order_currency: Option<String> =
        sqlx::query_scalar("SELECT currency FROM demo.orders WHERE id = $1 AND tenant = $2")
            .bind(payment.order_id)
            .bind(&tenant.0)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(match order_currency {
        None => Some(ApiError::NotFound("order")),
        Some(currency) if currency != payment.currency => {
            Some(ApiError::Validation(vec![FieldError::new(
                "currency",
                "currency_mismatch",
                format!("must equal the order currency ({currency})"),
            )]))
        }
        Some(_) => None,
    })
}

/// The payment row and its payment process, in the same transaction: business key = the payment
/// id, so the request's effect and its process commit together or not at all.
async fn insert_with_process(
    state: &AppState,
    tx: &mut PgConnection,
    tenant: &Tenant,
    payment: &validation::NewPayment,
    id: Uuid,
    now: DateTime<Utc>,
    traceparent: String,
) -> Result<(), ApiError> {
    sqlx::query(
        "INSERT INTO demo.payments (id, tenant, order_id, amount, currency, status, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, 'pending', $6, $6)",
    )
    .bind(id)
    .bind(&tenant.0)
    .bind(payment.order_id)
    .bind(payment.amount)
    .bind(&payment.currency)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    let flow = crate::payment_process::PaymentFlow::starter(
        state.settings.schema.clone(),
        state.settings.payment_remote,
    );
    let started = crate::payment_process::start(
        tx,
        &flow,
        &crate::payment_process::PaymentInput {
            payment_id: id,
            order_id: payment.order_id,
            tenant: tenant.0.clone(),
            amount: payment.amount,
            currency: payment.currency.clone(),
            traceparent,
        },
    )
    .await
    .map_err(|e| ApiError::Internal(format!("cannot start the payment process: {e}")))?;
    sqlx::query("UPDATE demo.payments SET process_id = $2 WHERE id = $1")
        .bind(id)
        .bind(started.id)
        .execute(&mut *tx)
        .await?;
    Ok(())
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
