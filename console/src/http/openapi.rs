//! The OpenAPI document of the JSON API, generated from the handlers' annotations (utoipa),
//! served at `/api/openapi.json`.

use crate::actions::{approvals, audit};
use crate::auth::users;
use crate::error;
use crate::http::{api, dto};
use crate::targets::{dead_letters, dependencies, ordered, outbox_dead, processes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "outbox console", description = "Dead outbox rows, consumer dead letters, ordered consumers' stuck aggregates, idempotency records, processes, approvals and the audit log. Every action takes a reason and the row version seen; more than one item needs a second person's approval."),
    paths(
        api::outbox::dead_rows, api::outbox::backlog, api::outbox::requeue_one, api::outbox::requeue_many,
        api::dead_letters::dead_letter_list, api::dead_letters::replay, api::idempotency::idempotency,
        api::audit::audit_list, api::audit::audit_purge, api::approvals::approval_list, api::approvals::approve,
        api::approvals::reject, api::processes::process_list, api::processes::process_get,
        api::processes::process_action, api::processes::process_bulk, api::ordered::ordered_view, api::ordered::ordered_action, api::whoami::whoami,
        api::dependencies::dependency_list, api::dependencies::dependency_action
    ),
    components(schemas(
        error::ErrorBody, outbox_dead::DeadRow, outbox_dead::Backlog, outbox_dead::Item, outbox_dead::Planned,
        dead_letters::Letter, dead_letters::Item, dead_letters::Planned, dto::RequeueOne, dto::RequeueMany,
        dto::Replay, dto::ReasonOnly, dto::IdempotencyRecord, audit::Entry, approvals::Approval, approvals::Decision,
        ProcessAction, processes::ProcessActionRequest, processes::RemoteCheck, processes::BulkRequest, processes::Frozen, dto::IdempotencyQuery,
        users::Principal, crate::auth::roles::Role, ordered::ConsumerView, ordered::StuckView, ordered::HeldView,
        ordered::PartitionView, ordered::AggregateAction, ordered::OrderedAction,
        dependencies::Dependency
    )),
    modifiers(&BearerAuth),
    security(("token" = []))
)]
pub struct ApiDoc;

/// The `ProcessAction` schema: the names of the process actions the console offers, taken from
/// the processes crate's vocabulary (`processes::admin::ActionKind`), which has no schema of its
/// own.
pub struct ProcessAction;

impl utoipa::PartialSchema for ProcessAction {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(processes::OFFERED.map(|k| k.name())))
            .into()
    }
}

impl utoipa::ToSchema for ProcessAction {
    fn name() -> std::borrow::Cow<'static, str> {
        "ProcessAction".into()
    }
}

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "Token from `console user create --name NAME --role ROLE`",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document as a value.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// `GET /api/openapi.json` (public: it describes, it reveals nothing).
pub async fn serve() -> Response {
    match document().to_json() {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
