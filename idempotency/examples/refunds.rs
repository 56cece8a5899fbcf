//! `POST /refunds` of a fictional payments service, made idempotent with the `idempotency` layer:
//! the refund row, its outbox message and the idempotency record commit in one transaction; a
//! retry with the same `Idempotency-Key` gets the first response again.
//!
//! ```sh
//! cargo run -p idempotency --example refunds   # DATABASE_URL, default the local test database
//! curl -i localhost:3000/refunds -H 'x-account: acme' -H 'idempotency-key: r-1' \
//!      -H 'content-type: application/json' -d '{"payment_id":"p-1","amount":500}'
//! ```

use axum::extract::{Extension, Request};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, http::StatusCode, routing::post};
use idempotency::{Effect, Idempotency, IdempotencyError, ResourceId};
use serde::{Deserialize, Serialize};
use serde_json::json;
use shared::NewMessage;
use shared::schema::Schema;

#[derive(Clone, Deserialize, Serialize)]
struct Refund {
    payment_id: String,
    amount: std::num::NonZeroU32, // 0, negative or not a number: 422 before the key is reserved
}

async fn create_refund(
    effect: Effect,
    Extension(refund): Extension<Refund>,
) -> Result<Response, IdempotencyError> {
    let id = uuid::Uuid::now_v7();
    let mut tx = effect.tx().await?; // the effect's own transaction; the layer commits it
    sqlx::query("INSERT INTO refunds (id, account, payment_id, amount) VALUES ($1, $2, $3, $4)")
        .bind(id)
        .bind(effect.scope())
        .bind(&refund.payment_id)
        .bind(i64::from(refund.amount.get()))
        .execute(&mut *tx)
        .await?;
    let event = NewMessage::new(
        "refund",
        id.to_string(),
        "refund.requested",
        json!({"id": id}),
    );
    shared::outbox::enqueue(&mut *tx, &event).await?; // same transaction
    Ok((StatusCode::CREATED, ResourceId(id), Json(json!({"id": id}))).into_response())
}

fn refunds(pool: sqlx::PgPool) -> Router {
    let idempotent = Idempotency::new(pool) // records in outbox.idempotency_keys
        .route("create_refund")
        .scope(|parts| parts.extensions.get::<Account>().map(|a| a.0.clone()))
        .json::<Refund>()
        .location(|id| format!("/refunds/{id}"));
    Router::new().route("/refunds", post(create_refund).route_layer(idempotent))
}

/// What the service's own authentication puts into the request (here: trusts a header).
#[derive(Clone)]
struct Account(String);

async fn authenticate(mut request: Request, next: Next) -> Response {
    let account = request
        .headers()
        .get("x-account")
        .and_then(|v| v.to_str().ok());
    let Some(account) = account.map(str::to_owned) else {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "who are you?"})),
        )
            .into_response();
    };
    request.extensions_mut().insert(Account(account));
    next.run(request).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = sqlx::PgPool::connect(&url).await?;
    let schema = Schema::default(); // the product schema: outbox.messages, outbox.idempotency_keys
    shared::migrate::run(&pool, &schema).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS refunds (id uuid PRIMARY KEY, account text NOT NULL, \
         payment_id text NOT NULL, amount bigint NOT NULL CHECK (amount > 0))",
    )
    .execute(&pool)
    .await?;
    let app = refunds(pool).layer(middleware::from_fn(authenticate));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await?;
    Ok(())
}
