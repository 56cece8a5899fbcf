//! `/api/idempotency`: idempotency records by scope and key, status and times only.

use super::{Bearer, read};
use crate::error::ConsoleError;
use crate::http::dto::{IdempotencyQuery, IdempotencyRecord};
use crate::redact;
use crate::state::AppState;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

/// Look up idempotency records by scope and key (a read, sent as a POST: the key is in the body).
#[utoipa::path(post, path = "/api/idempotency", tag = "idempotency", request_body = IdempotencyQuery,
    responses((status = 200, body = [IdempotencyRecord])))]
pub async fn idempotency(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "idempotency").await?;
    let q: IdempotencyQuery = serde_json::from_slice(&body)
        .map_err(|e| ConsoleError::BadRequest(format!("invalid JSON body: {e}")))?;
    Ok(Json(lookup_idempotency(&s, &q.scope, &q.key).await?).into_response())
}

/// The records of `key` in `scope`, through the `idempotency` crate (which owns the table).
pub async fn lookup_idempotency(
    s: &AppState,
    scope: &str,
    key: &str,
) -> Result<Vec<IdempotencyRecord>, ConsoleError> {
    crate::text::check_all([("scope", Some(scope)), ("key", Some(key))])?;
    let rows = s.idempotency.lookup(scope, key).await?;
    Ok(rows
        .into_iter()
        .map(|r| IdempotencyRecord {
            operation: redact::text(&r.operation),
            status: r.status,
            response_status: r.response_status,
            resource_id: r.resource_id,
            created_at: r.created_at,
            updated_at: r.updated_at,
            expires_at: r.expires_at,
            lease_expires_at: r.lease_expires_at,
        })
        .collect())
}
