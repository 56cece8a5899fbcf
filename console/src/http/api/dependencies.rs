//! `/api/dependencies...`: each remote's shared circuit with the processes waiting for it, and an
//! operator's hand on the circuit.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::{Action, Caller, commands};
use crate::error::ConsoleError;
use crate::http::dto::ReasonOnly;
use crate::state::AppState;
use crate::targets::dependencies;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};

/// Every dependency: its circuit (state, since when it is down, the next probe, the last error)
/// and the processes waiting for it by kind; those that are down first.
#[utoipa::path(get, path = "/api/dependencies", tag = "dependencies",
    responses((status = 200, body = [dependencies::Dependency]), (status = 401, body = crate::error::ErrorBody)))]
pub async fn dependency_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "dependencies").await?;
    Ok(Json(dependencies::list(&s.pool, &s.schema).await?).into_response())
}

/// Hold a dependency's circuit open by hand (`open`) or close it (`close`) (operator): a reason
/// is required; the audit entry has the circuit before and after.
#[utoipa::path(post, path = "/api/dependencies/{name}/actions/{action}", tag = "dependencies",
    request_body = ReasonOnly,
    params(("name" = String, Path), ("action" = String, Path, description = "open or close"),
           ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "the circuit after"), (status = 400, body = crate::error::ErrorBody),
               (status = 403, body = crate::error::ErrorBody), (status = 404, body = crate::error::ErrorBody)))]
pub async fn dependency_action(
    call: Caller,
    Path((name, action)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let open = match action.as_str() {
        "open" => true,
        "close" => false,
        other => {
            return Err(ConsoleError::NotFound(format!(
                "no dependency action {:?}: open or close",
                crate::text::printable(other)
            )));
        }
    };
    if !breaker::valid_name(&name) {
        return Err(ConsoleError::BadRequest(
            "a dependency name is 1-100 characters of A-Z a-z 0-9 . _ -".into(),
        ));
    }
    let target = format!("dependency:{name}");
    let b: ReasonOnly = parse_for(&call, Action::DependencyCircuit(open), &target, &body).await?;
    Ok(outcome_response(
        commands::dependency_circuit(&call, &name, open, &b.reason).await?,
    ))
}
