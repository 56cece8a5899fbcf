//! The idempotency lookup page: a key's records by scope, status and times only (the bodies are
//! never shown). A POST, so the key never travels in a URL (history, logs, `Referer`).

use super::forms::{Fields, csrf, field};
use super::layout::{page, shown};
use super::session::WebSession;
use crate::auth::sessions::Session;
use crate::state::AppState;
use axum::Form;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

/// The lookup form.
fn idempotency_form(session: &Session) -> Markup {
    html! {
        form method="post" action="/idempotency" id="idempotency-form" {
            input type="hidden" name="csrf" value=(session.csrf);
            "scope " input name="scope" id="idempotency-scope";
            " key " input name="key" type="password" id="idempotency-key";
            " " button id="idempotency-lookup" { "Look up" }
        }
        p { "Status and times only; request and response bodies are never shown." }
    }
}

/// `GET /idempotency`.
pub async fn idempotency_page(WebSession(session): WebSession) -> Response {
    page(
        Some(&session),
        "Idempotency records",
        idempotency_form(&session),
    )
    .into_response()
}

/// `POST /idempotency`: the form and the records found.
pub async fn idempotency_lookup(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Form(f): Form<Fields>,
) -> Response {
    if let Err(r) = csrf(&s, &session, &f, "idempotency.lookup").await {
        return r;
    }
    let found = match (field(&f, "scope"), field(&f, "key")) {
        (Some(scope), Some(key)) => {
            Some(crate::http::api::lookup_idempotency(&s, scope, key).await)
        }
        _ => None,
    };
    let body = html! {
        (idempotency_form(&session))
        @match found {
            Some(Ok(rows)) => table {
                tr {
                    th { "operation" } th { "status" } th { "response" } th { "resource" }
                    th { "created" } th { "updated" } th { "expires" }
                }
                @for r in rows {
                    tr {
                        td { (shown(&r.operation)) }
                        td { (shown(&r.status)) }
                        td { @if let Some(st) = r.response_status { (st) } }
                        td { @if let Some(id) = r.resource_id { (id) } }
                        td { (r.created_at) }
                        td { (r.updated_at) }
                        td { (r.expires_at) }
                    }
                }
            },
            Some(Err(e)) => p.error { (shown(&e.public_message())) },
            None => {},
        }
    };
    page(Some(&session), "Idempotency records", body).into_response()
}
