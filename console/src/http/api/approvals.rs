//! `/api/approvals...`: approval requests; approving or rejecting another person's.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::approvals::{self, Decision};
use crate::actions::{Action, Caller, commands};
use crate::error::ConsoleError;
use crate::http::dto::StatusQuery;
use crate::state::AppState;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

/// Approval requests, newest first.
#[utoipa::path(get, path = "/api/approvals", tag = "approvals", params(StatusQuery), responses((status = 200, body = [approvals::Approval])))]
pub async fn approval_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(q): Query<StatusQuery>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "approvals").await?;
    crate::text::check("status", q.status.as_deref().unwrap_or(""))?;
    Ok(Json(approvals::list(&s.pool, &s, q.status.as_deref()).await?).into_response())
}

async fn decide(
    call: Caller,
    id: Uuid,
    body: Bytes,
    approve: bool,
) -> Result<Response, ConsoleError> {
    let action = Action::decision(approve);
    let d: Decision = parse_for(&call, action, &format!("approval:{id}"), &body).await?;
    Ok(outcome_response(
        commands::decide(&call, id, d, approve).await?,
    ))
}

/// Approve a request of someone else (approver): the effect runs now, once.
#[utoipa::path(post, path = "/api/approvals/{id}/approve", tag = "approvals", request_body = Decision,
    params(("id" = Uuid, Path)), responses((status = 200), (status = 403), (status = 409)))]
pub async fn approve(
    call: Caller,
    Path(id): Path<Uuid>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    decide(call, id, body, true).await
}

/// Reject a request of someone else (approver): nothing runs.
#[utoipa::path(post, path = "/api/approvals/{id}/reject", tag = "approvals", request_body = Decision,
    params(("id" = Uuid, Path)), responses((status = 200), (status = 403), (status = 409)))]
pub async fn reject(
    call: Caller,
    Path(id): Path<Uuid>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    decide(call, id, body, false).await
}
