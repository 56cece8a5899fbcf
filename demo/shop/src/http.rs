//! The router: API routes behind the API-key middleware, the ops routes (`/metrics`, `/healthz`,
//! `/readyz`), `/openapi.json`, JSON fallbacks for unknown routes and methods, a request-duration
//! middleware and a panic guard; and the server that runs it with the background tasks.

use crate::error::ApiError;
use crate::state::AppState;
use crate::{ProducerError, auth, internal_events, openapi, orders, payments, provider_webhooks};
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::http::Method;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::FutureExt;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The whole HTTP surface of the producer.
pub fn app(state: AppState) -> Router {
    internal_events::describe();
    let api = Router::new()
        .route(
            "/orders",
            post(orders::create_order).route_layer(orders::idempotency(&state)),
        )
        .route("/orders/{id}", get(orders::get_order))
        .route(
            "/payments",
            post(payments::create_payment).route_layer(payments::idempotency(&state)),
        )
        .route("/payments/{id}", get(payments::get_payment))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_tenant,
        ))
        .layer(DefaultBodyLimit::max(state.settings.body_limit))
        .with_state(state.clone());
    // The provider's webhooks: outside the API-key middleware (the signature authenticates them)
    // and with the receiver's own body limit.
    let webhooks = match &state.settings.provider_webhook_secret {
        Some(secret) => Router::new().route(
            "/webhooks/provider",
            provider_webhooks::receiver(state.pool.clone(), state.settings.schema.clone(), secret)
                .into_route(),
        ),
        None => Router::new(),
    };
    Router::new()
        .route("/openapi.json", get(openapi::serve))
        .merge(api)
        .merge(webhooks)
        .merge(plumbing::telemetry::ops_router(state.readiness.clone()))
        .fallback(|| async { ApiError::NotFound("route") })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(middleware::from_fn(catch_panics))
        .layer(middleware::from_fn(track_requests))
}

/// Records `api_request_duration_seconds` by route template (never the raw path).
async fn track_requests(request: Request, next: Next) -> Response {
    let start = Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    let method = method_label(request.method());
    let response = next.run(request).await;
    internal_events::request_finished(
        route.as_deref().unwrap_or("unmatched"),
        method,
        response.status().as_u16(),
        start.elapsed(),
    );
    response
}

fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// A panic anywhere in a handler becomes a plain 500 (idempotent POSTs release their key first).
async fn catch_panics(request: Request, next: Next) -> Response {
    match AssertUnwindSafe(next.run(request)).catch_unwind().await {
        Ok(response) => response,
        Err(_) => ApiError::Panicked("handler panicked".into()).into_response(),
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until the server stopped (after shutdown, once in-flight requests finished).
    pub async fn wait(self) -> Result<(), ProducerError> {
        self.task
            .await
            .map_err(ProducerError::Join)?
            .map_err(ProducerError::Serve)
    }
}

/// Binds `addr` and serves [`app`] until `shutdown`, with the purge and readiness tasks.
pub async fn start(
    state: AppState,
    addr: SocketAddr,
    shutdown: CancellationToken,
) -> Result<Server, ProducerError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ProducerError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| ProducerError::Bind { addr, source })?;
    if let Some(interval) = state.settings.purge_interval {
        let purge = idempotency::PurgeSettings {
            interval,
            batch_size: state.settings.purge_batch_size,
            max_batches: state.settings.purge_max_batches,
        };
        tokio::spawn(idempotency::purge_loop(
            state.idempotency.clone(),
            purge,
            shutdown.clone().cancelled_owned(),
        ));
        if state.settings.provider_webhook_secret.is_some() {
            tokio::spawn(idempotency::webhooks::inbox::purge_loop(
                state.pool.clone(),
                state.settings.schema.clone(),
                state.settings.webhook_inbox_retention,
                interval,
                i64::from(state.settings.purge_batch_size),
                shutdown.clone().cancelled_owned(),
            ));
        }
    }
    tokio::spawn(readiness_loop(state.clone(), shutdown.clone()));
    let router = app(state);
    let task = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
    });
    Ok(Server { addr: local, task })
}

/// Keeps `/readyz` honest: PostgreSQL must answer `SELECT 1` within two seconds.
async fn readiness_loop(state: AppState, shutdown: CancellationToken) {
    loop {
        let ok = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::query("SELECT 1").execute(&state.pool),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        if ok != state.readiness.postgres() {
            tracing::info!(postgres = ok, "readiness changed");
        }
        state.readiness.set_postgres(ok);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(state.settings.readiness_interval) => {}
        }
    }
}
