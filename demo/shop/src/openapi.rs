//! The OpenAPI document, generated from the handlers' annotations and the types (utoipa), served at
//! `/openapi.json`.

use crate::error::{ErrorBody, FieldError, ValidationErrorBody};
use crate::{orders, payments};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "producer",
        description = "Orders and payments with idempotency keys; every change is written with its outbox event in one transaction."
    ),
    paths(orders::create_order, orders::get_order, payments::create_payment, payments::get_payment),
    components(schemas(ErrorBody, ValidationErrorBody, FieldError)),
    modifiers(&BearerAuth),
    tags(
        (name = "orders", description = "Placing and reading orders"),
        (name = "payments", description = "Requesting payments (asynchronous) and reading their state"),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("API key from `producer api-key create --tenant NAME`"))
                    .build(),
            ),
        );
    }
}

/// The document as a value.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// `GET /openapi.json`.
pub(crate) async fn serve() -> Response {
    match document().to_json() {
        Ok(json) => {
            let mut response = (StatusCode::OK, json).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(e) => crate::error::ApiError::Internal(e.to_string()).into_response(),
    }
}
