//! The router ([`app`]) and the server ([`start`]).

use crate::error::ApiError;
use crate::state::AppState;
use crate::{admin, charges, refunds};
use axum::Router;
use axum::routing::{get, post};
use plumbing::telemetry::Readiness;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Every route: the API, the admin routes, `/metrics`, `/healthz`, `/readyz`.
pub fn app(state: AppState, readiness: Arc<Readiness>) -> Router {
    let api = Router::new()
        .route("/charges", post(charges::create).get(charges::by_reference))
        .route("/charges/{id}", get(charges::get))
        .route("/refunds", post(refunds::create))
        .route("/notifications", post(crate::notifications::create))
        .route_layer(axum::middleware::from_fn_with_state(
            state.outage.clone(),
            crate::outage::refuse_while_down,
        ));
    Router::new()
        .merge(api)
        .route(
            "/admin/charges",
            get(admin::charges).post(admin::create_charge),
        )
        .route("/admin/charges/{id}", post(admin::edit_charge))
        .route("/admin/faults", get(admin::faults).post(admin::set_faults))
        .route("/admin/mode", get(admin::mode).post(admin::set_mode))
        .route("/admin/outage", get(admin::outage).post(admin::set_outage))
        .route("/admin/events", get(admin::events))
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async {
            (
                axum::http::StatusCode::METHOD_NOT_ALLOWED,
                axum::Json(serde_json::json!({"error": "method not allowed on this route"})),
            )
        })
        .with_state(state)
        .merge(plumbing::telemetry::ops_router(readiness))
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    local_addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the server stopped (after `shutdown` and the grace period).
    pub async fn wait(self) -> Result<(), tokio::task::JoinError> {
        self.task.await
    }
}

/// Binds `addr` (port 0 works) and serves until `shutdown`.
pub async fn start(
    state: AppState,
    readiness: Arc<Readiness>,
    addr: SocketAddr,
    shutdown: CancellationToken,
) -> std::io::Result<Server> {
    let listener = TcpListener::bind(addr).await?;
    let local_addr = listener.local_addr()?;
    let task = tokio::spawn(crate::connection::serve(
        listener,
        app(state, readiness),
        shutdown,
    ));
    Ok(Server { local_addr, task })
}
