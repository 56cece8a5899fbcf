//! The HTTP surface: the JSON API by target ([`api`]) with its DTOs ([`dto`]) and OpenAPI document
//! ([`openapi`]), the server-rendered pages ([`pages`]), and what wraps every answer: the
//! idempotency layer on actions ([`keys`]), security headers ([`headers`]), cross-site POSTs
//! refused ([`origin`]). [`serve`] starts it all.

pub mod api;
pub mod dto;
pub mod headers;
pub mod keys;
pub mod openapi;
pub mod origin;
pub mod pages;
pub mod serve;

use crate::state::AppState;
use axum::Router;
use axum::routing::get;
use plumbing::telemetry::Readiness;
use std::sync::Arc;

/// The whole router for `state`: API, OpenAPI document, pages, ops routes, and the layers every
/// answer goes through.
pub fn router(state: AppState, readiness: Arc<Readiness>) -> Router {
    Router::new()
        .merge(api::router(&state))
        .route("/api/openapi.json", get(openapi::serve))
        .merge(pages::router())
        .fallback(api::not_found)
        .with_state(state)
        .merge(plumbing::telemetry::ops_router(readiness))
        .layer(axum::middleware::from_fn(origin::same_origin_posts))
        .layer(axum::middleware::from_fn(headers::security_headers))
}
