//! `POST /notifications`: a notification service's endpoint, for the example's consumer that
//! calls a remote (`producer notifier`). The Idempotency-Key is required; a notification is kept
//! once per key (201 the first time, 200 for a replay), and every post is counted. Behind the
//! outage switch like the rest of the API.

use crate::api::IDEMPOTENCY_KEY_HEADER;
use crate::error::{ApiError, Body};
use crate::state::AppState;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::Serialize;
use serde_json::Value;

/// The answer of `POST /notifications`.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Notified {
    pub idempotency_key: String,
    /// How often this key has been posted (1 the first time).
    pub posts: i32,
}

/// `POST /notifications` with any JSON object and an `Idempotency-Key`.
pub async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    Body(body): Body<Value>,
) -> Result<(StatusCode, Json<Notified>), ApiError> {
    let key = headers
        .get(IDEMPOTENCY_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|k| (1..=255).contains(&k.len()))
        .ok_or_else(|| {
            ApiError::BadRequest("an Idempotency-Key of 1-255 bytes is required".into())
        })?
        .to_string();
    if !body.is_object() {
        return Err(ApiError::BadRequest(
            "the notification must be a JSON object".into(),
        ));
    }
    let posts: i32 = sqlx::query_scalar(
        "INSERT INTO provider.notifications (idempotency_key, body) VALUES ($1, $2) \
         ON CONFLICT (idempotency_key) DO UPDATE SET posts = provider.notifications.posts + 1 \
         RETURNING posts",
    )
    .bind(&key)
    .bind(&body)
    .fetch_one(&state.pool)
    .await?;
    let status = if posts == 1 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(Notified {
            idempotency_key: key,
            posts,
        }),
    ))
}
