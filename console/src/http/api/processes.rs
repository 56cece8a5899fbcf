//! `/api/processes...`: processes, one process, and the actions it offers now.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::{Action, Caller, commands};
use crate::error::ConsoleError;
use crate::redact;
use crate::state::AppState;
use crate::targets::processes::{BulkRequest, ProcessActionRequest, ProcessQuery};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use processes::admin::ActionKind;
use uuid::Uuid;

/// Processes matching a search and filters, newest first, one keyset page at a time:
/// `{items, total, next, counts}`. `total` is how many match in all, `next` the `after` of the
/// next page (null on the last), `counts` how many processes have each status.
#[utoipa::path(get, path = "/api/processes", tag = "processes", params(ProcessQuery),
    responses((status = 200, description = "{items, total, next, counts}"),
               (status = 400, description = "a filter or cursor that is none", body = crate::error::ErrorBody)))]
pub async fn process_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(f): Query<ProcessQuery>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "processes").await?;
    let query = f.check()?;
    let page = s.processes.find(&s.pool, &query).await?;
    Ok(Json(redact::value(&page)).into_response())
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
    call: Caller,
    Path((id, action)): Path<(Uuid, String)>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let action = offered(&action)?;
    let target = format!("process:{id}");
    let r: ProcessActionRequest = parse_for(&call, Action::Process(action), &target, &body).await?;
    Ok(outcome_response(
        commands::process_action(&call, id, action, r).await?,
    ))
}

/// A process action on every process a filter selects (rerun_step, query_remote_status,
/// escalate, pause, resume). `dry_run` lists the matching processes with their versions and
/// whether the action is allowed on each, changing nothing; otherwise the allowed ones are frozen
/// as (id, version) in one approval request (202), whose approval acts on exactly them and skips
/// (and reports) any that moved on.
#[utoipa::path(post, path = "/api/processes/actions/{action}", tag = "processes", request_body = BulkRequest,
    params(("action" = String, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "dry run: {dry_run, action, step, matching, selected, items}"),
               (status = 202, description = "approval request created: {approval, status, existing, selected, items}"),
               (status = 400, description = "a filter that is none, an action not offered in bulk, nothing selected", body = crate::error::ErrorBody),
               (status = 403, body = crate::error::ErrorBody)))]
pub async fn process_bulk(
    call: Caller,
    Path(action): Path<String>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let action = offered(&action)?;
    let r: BulkRequest = parse_for(&call, Action::Process(action), "processes", &body).await?;
    Ok(outcome_response(
        commands::process_bulk(&call, action, r).await?,
    ))
}

/// The offered process action named `name` in the path; 404 for any other name.
fn offered(name: &str) -> Result<ActionKind, ConsoleError> {
    crate::targets::processes::parse_action(name)
        .ok_or_else(|| ConsoleError::NotFound(format!("process action {name:?}")))
}
