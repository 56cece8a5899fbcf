//! `POST /orders` (idempotent, writes the order, its lines and an `order.placed` event in one
//! transaction) and `GET /orders/{id}` (tenant-scoped).

use crate::auth::Tenant;
use crate::error::{ApiError, ErrorBody, ValidationErrorBody};
use crate::fault::{Operation, Stage};
use crate::state::AppState;
use crate::{idempotent_post, trace_context, validation};
use axum::Extension;
use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use idempotency::{Effect, IdempotencyLayer, ResourceId};
use serde::{Deserialize, Serialize};
use shared::NewMessage;
use tracing::Instrument;
use utoipa::ToSchema;
use uuid::Uuid;

/// Body of `POST /orders`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateOrderRequest {
    /// Caller's customer reference, 1-255 characters.
    #[schema(example = "cust-42", min_length = 1, max_length = 255)]
    pub customer_id: String,
    /// Three upper-case letters.
    #[schema(example = "EUR", pattern = "^[A-Z]{3}$")]
    pub currency: String,
    /// 1 to 100 lines.
    #[schema(min_items = 1, max_items = 100)]
    pub items: Vec<CreateOrderItem>,
}

/// One line of `POST /orders`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateOrderItem {
    #[schema(example = "sku-1", min_length = 1, max_length = 64)]
    pub sku: String,
    /// Units, > 0: a JSON integer or a string of digits.
    pub quantity: PositiveInteger,
    /// Price of one unit in minor units, > 0: a JSON integer or a string of digits.
    pub unit_price: PositiveInteger,
}

/// A positive integer within i64: a JSON integer, or a string of ASCII digits only (no sign,
/// spaces, decimals or exponent).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PositiveInteger {
    /// A JSON integer, 1 to 9223372036854775807.
    Integer(i64),
    /// ASCII digits only (`^[0-9]+$`), value 1 to 9223372036854775807.
    Digits(String),
}

/// An order as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Order {
    pub id: Uuid,
    pub customer_id: String,
    pub currency: String,
    pub items: Vec<OrderItem>,
    /// Sum of the line totals, minor units.
    pub total_amount: i64,
    /// `placed`, later `paid` or `cancelled` (set downstream).
    #[schema(example = "placed")]
    pub status: String,
    pub created_at: DateTime<Utc>,
}

/// One line of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, sqlx::FromRow)]
pub struct OrderItem {
    pub sku: String,
    pub quantity: i64,
    pub unit_price: i64,
    /// quantity * unit_price, minor units.
    pub line_total: i64,
}

/// Response of `POST /orders`: the order, and whether this response is a replay.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OrderCreated {
    #[serde(flatten)]
    pub order: Order,
    /// `false` on the first response, `true` when replayed for a retry with the same key.
    pub replayed: bool,
}

/// Places an order.
#[utoipa::path(
    post,
    path = "/orders",
    tag = "orders",
    request_body = CreateOrderRequest,
    params(
        ("Idempotency-Key" = String, Header, description = "1-255 printable ASCII characters naming this intent; retries reuse it"),
        ("traceparent" = Option<String>, Header, description = "W3C trace context to continue"),
    ),
    responses(
        (status = 201, description = "Order placed (or the replay of it)", body = OrderCreated,
         headers(("Location" = String, description = "/orders/{id}"),
                 ("Idempotent-Replayed" = Option<String>, description = "`true` on replays"))),
        (status = 400, description = "Missing or invalid Idempotency-Key, or unreadable JSON", body = ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
        (status = 409, description = "A request with this key is still processing (see Retry-After)", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 415, description = "Content-Type is not application/json", body = ErrorBody),
        (status = 422, description = "Validation failed (`errors`), or the key was used with another payload (`error`)", body = ValidationErrorBody),
    ),
    security(("api_key" = []))
)]
pub async fn create_order(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(order): Extension<validation::NewOrder>,
    effect: Effect,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (span, traceparent) = trace_context::request_span(&headers, "create_order");
    place(state, effect, tenant, order, traceparent)
        .instrument(span)
        .await
}

/// The Idempotency-Key layer of `POST /orders`: scoped by tenant, fingerprinted over the validated
/// order (which the handler gets as an extension).
pub(crate) fn idempotency(state: &AppState) -> IdempotencyLayer {
    idempotent_post::layer(
        state,
        Operation::CreateOrder,
        validation::order,
        validation::NewOrder::normalized,
    )
}

async fn place(
    state: AppState,
    effect: Effect,
    tenant: Tenant,
    order: validation::NewOrder,
    traceparent: String,
) -> Result<Response, ApiError> {
    state.hook(Stage::Reserved, Operation::CreateOrder).await?;
    let now = effect.now();
    let id = Uuid::now_v7();
    let created = OrderCreated {
        order: Order {
            id,
            customer_id: order.customer_id.clone(),
            currency: order.currency.clone(),
            items: order
                .items
                .iter()
                .map(|i| OrderItem {
                    sku: i.sku.clone(),
                    quantity: i.quantity,
                    unit_price: i.unit_price,
                    line_total: i.line_total,
                })
                .collect(),
            total_amount: order.total_amount,
            status: "placed".into(),
            created_at: now,
        },
        replayed: false,
    };
    let body = serde_json::to_string(&created).map_err(|e| ApiError::Internal(e.to_string()))?;

    let event = serde_json::json!({
        "order_id": id,
        "tenant": tenant.0,
        "customer_id": order.customer_id,
        "currency": order.currency,
        "items": created.order.items,
        "total_amount": order.total_amount,
        "placed_at": now,
    });
    let message = NewMessage::new("order", id.to_string(), "order.placed", event)
        .with_header("traceparent", traceparent)
        .with_header("tenant", tenant.0.clone());
    tracing::Span::current().record("message_id", tracing::field::display(message.id));

    // The effect's transaction: it begins by locking the record under our fencing token (a holder
    // that lost its lease stops here); the layer completes the record in it and commits.
    let mut tx = effect.tx().await?;
    sqlx::query(
        "INSERT INTO demo.orders (id, tenant, customer_id, currency, total_amount, status, created_at) \
         VALUES ($1, $2, $3, $4, $5, 'placed', $6)",
    )
    .bind(id)
    .bind(&tenant.0)
    .bind(&order.customer_id)
    .bind(&order.currency)
    .bind(order.total_amount)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    let line_nos: Vec<i32> = (1..).take(order.items.len()).collect();
    let skus: Vec<&str> = order.items.iter().map(|i| i.sku.as_str()).collect();
    let quantities: Vec<i64> = order.items.iter().map(|i| i.quantity).collect();
    let prices: Vec<i64> = order.items.iter().map(|i| i.unit_price).collect();
    let totals: Vec<i64> = order.items.iter().map(|i| i.line_total).collect();
    sqlx::query(
        "INSERT INTO demo.order_items (order_id, line_no, sku, quantity, unit_price, line_total) \
         SELECT $1, * FROM UNNEST($2::int[], $3::text[], $4::bigint[], $5::bigint[], $6::bigint[])",
    )
    .bind(id)
    .bind(&line_nos)
    .bind(&skus)
    .bind(&quantities)
    .bind(&prices)
    .bind(&totals)
    .execute(&mut *tx)
    .await?;
    idempotent_post::enqueue_and_finish(&state, tx, &message, Operation::CreateOrder).await?;
    Ok(json_response(StatusCode::CREATED, ResourceId(id), body))
}

/// A JSON response with the parts the idempotency layer reads.
pub(crate) fn json_response(
    status: StatusCode,
    parts: impl axum::response::IntoResponseParts,
    body: String,
) -> Response {
    (
        status,
        parts,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

/// Reads an order of the caller's tenant.
#[utoipa::path(
    get,
    path = "/orders/{id}",
    tag = "orders",
    params(("id" = Uuid, Path, description = "Order id")),
    responses(
        (status = 200, description = "The order", body = Order),
        (status = 401, description = "Missing or invalid API key", body = ErrorBody),
        (status = 404, description = "No such order for this tenant", body = ErrorBody),
    ),
    security(("api_key" = []))
)]
pub async fn get_order(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<Order>, ApiError> {
    let id = parse_id(id).ok_or(ApiError::NotFound("order"))?;
    let row: Option<(Uuid, String, String, i64, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT id, customer_id, currency, total_amount, status, created_at \
         FROM demo.orders WHERE id = $1 AND tenant = $2",
    )
    .bind(id)
    .bind(&tenant.0)
    .fetch_optional(&state.pool)
    .await?;
    let Some((id, customer_id, currency, total_amount, status, created_at)) = row else {
        return Err(ApiError::NotFound("order"));
    };
    let items: Vec<OrderItem> = sqlx::query_as(
        "SELECT sku, quantity, unit_price, line_total FROM demo.order_items WHERE order_id = $1 ORDER BY line_no",
    )
    .bind(id)
    .fetch_all(&state.pool)
    .await?;
    Ok(Json(Order {
        id,
        customer_id,
        currency,
        items,
        total_amount,
        status,
        created_at,
    }))
}

/// A path id as a UUID; anything else names no resource.
pub(crate) fn parse_id(id: Result<Path<String>, PathRejection>) -> Option<Uuid> {
    let Path(raw) = id.ok()?;
    Uuid::try_parse(&raw).ok()
}
