//! `/api/processes...`: processes, one process, and the actions it offers now.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::{Action, commands};
use crate::error::ConsoleError;
use crate::http::keys::Keyed;
use crate::redact;
use crate::state::AppState;
use crate::targets::processes::{ProcessActionRequest, ProcessFilter};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

/// Processes, manual_review first, then most recently changed.
#[utoipa::path(get, path = "/api/processes", tag = "processes", params(ProcessFilter), responses((status = 200)))]
pub async fn process_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(f): Query<ProcessFilter>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "processes").await?;
    f.check()?;
    let list = s.processes.list(&s.pool, &f).await?;
    Ok(Json(list.iter().map(redact::value).collect::<Vec<_>>()).into_response())
}

/// One process: its steps, last classified error, history, `version` and the actions allowed now.
#[utoipa::path(get, path = "/api/processes/{id}", tag = "processes", params(("id" = Uuid, Path)), responses((status = 200), (status = 404)))]
pub async fn process_get(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, &format!("process:{id}")).await?;
    let v = s
        .processes
        .get(&s.pool, id)
        .await?
        .ok_or_else(|| ConsoleError::NotFound(format!("process {id}")))?;
    Ok(Json(redact::value(&v)).into_response())
}

/// Perform an action on a process: one the process offers now (`allowed_actions`); the sensitive
/// ones (run_compensation, resolve_succeeded) create an approval request.
#[utoipa::path(post, path = "/api/processes/{id}/actions/{action}", tag = "processes", request_body = ProcessActionRequest,
    params(("id" = Uuid, Path), ("action" = String, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "done"), (status = 202, description = "approval request created"), (status = 403, body = crate::error::ErrorBody),
               (status = 409, description = "stale version or not allowed now: nothing changed", body = crate::error::ErrorBody),
               (status = 422, description = "Idempotency-Key used for another request", body = crate::error::ErrorBody)))]
pub async fn process_action(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path((id, action)): Path<(Uuid, String)>,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let action = crate::targets::processes::parse_action(&action)
        .ok_or_else(|| ConsoleError::NotFound(format!("process action {action:?}")))?;
    let r: ProcessActionRequest = parse_for(
        &s,
        &p,
        Action::Process(action),
        &format!("process:{id}"),
        &body,
    )
    .await?;
    Ok(outcome_response(
        commands::process_action(&s, &p, id, action, r, keyed).await?,
    ))
}
