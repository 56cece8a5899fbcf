//! The JSON API under `/api`, for bearer tokens (`Authorization: Bearer ct_...`). Every response
//! is redacted; every error is `{"error": "..."}`. The web page's forms are forwarded to the same
//! action routes ([`forward`]), so both go through one path: authentication, the Idempotency-Key
//! ([`crate::auth::keys`]), the role check and the action.

mod answers;
pub mod approvals;
pub mod audit;
mod bearer;
pub mod dead_letters;
pub mod dependencies;
pub mod idempotency;
pub mod ordered;
pub mod outbox;
pub mod processes;
pub mod whoami;

pub use answers::{not_found, outcome_response};
pub use bearer::Bearer;
pub use idempotency::lookup_idempotency;

use crate::auth::users::{Authenticated, Principal};
use crate::error::ConsoleError;
use crate::http::keys;
use crate::state::AppState;
use answers::{json_errors, parse_for};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bearer::{authenticate, read};

/// Middleware of the action routes: after an action (committed by then, also through the
/// idempotency layer), the pending-approvals gauge.
async fn settle(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    // Only an action that was done (or requested for approval) can change the count.
    if response.status().is_success() {
        crate::actions::approvals::refresh_pending_gauge(&state).await;
    }
    response
}

/// Every route of the API.
pub fn router(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/api/outbox/dead", get(outbox::dead_rows))
        .route("/api/outbox/backlog", get(outbox::backlog))
        .route("/api/dead-letters", get(dead_letters::dead_letter_list))
        .route("/api/idempotency", post(idempotency::idempotency))
        .route("/api/audit", get(audit::audit_list))
        .route("/api/approvals", get(approvals::approval_list))
        .route("/api/processes", get(processes::process_list))
        .route("/api/processes/{id}", get(processes::process_get))
        .route(
            "/api/consumers/{consumer}/ordered",
            get(ordered::ordered_view),
        )
        .route("/api/dependencies", get(dependencies::dependency_list))
        .route("/api/whoami", get(whoami::whoami))
        .merge(actions(state))
        .layer(axum::middleware::from_fn(json_errors))
}

/// The action routes: authentication, then the Idempotency-Key ([`keys::optional`]), then the
/// handler.
pub fn actions(state: &AppState) -> Router<AppState> {
    Router::new()
        .route(
            "/api/outbox/dead/actions/requeue",
            post(outbox::requeue_many),
        )
        .route(
            "/api/outbox/dead/{id}/actions/requeue",
            post(outbox::requeue_one),
        )
        .route(
            "/api/dead-letters/{consumer}/actions/replay",
            post(dead_letters::replay),
        )
        .route("/api/audit/actions/purge", post(audit::audit_purge))
        .route(
            "/api/dependencies/{name}/actions/{action}",
            post(dependencies::dependency_action),
        )
        .route("/api/approvals/{id}/approve", post(approvals::approve))
        .route("/api/approvals/{id}/reject", post(approvals::reject))
        .route(
            "/api/processes/{id}/actions/{action}",
            post(processes::process_action),
        )
        .route(
            "/api/processes/actions/{action}",
            post(processes::process_bulk),
        )
        .route(
            "/api/consumers/{consumer}/ordered/actions/{action}",
            post(ordered::ordered_action),
        )
        .route_layer(from_fn_with_state(state.clone(), keys::optional))
        .route_layer(from_fn_with_state(state.clone(), authenticate))
        .route_layer(from_fn_with_state(state.clone(), settle))
}

/// Sends a web form's action, as `principal`, to the action route `path` with JSON `body` and the
/// form's Idempotency-Key: the same path an API client's request takes.
pub async fn forward(
    state: &AppState,
    principal: &Principal,
    path: &str,
    key: Option<&str>,
    body: &serde_json::Value,
) -> Response {
    let mut builder = axum::http::Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = key {
        builder = builder.header(::idempotency::KEY_HEADER, k);
    }
    let mut request = match builder.body(Body::from(body.to_string())) {
        Ok(r) => r,
        Err(_) => {
            return ConsoleError::BadRequest("the form's idempotency key is malformed".into())
                .into_response();
        }
    };
    request
        .extensions_mut()
        .insert(Authenticated(principal.clone()));
    let mut router = actions(state).with_state(state.clone());
    match tower_service::Service::call(&mut router, request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}
