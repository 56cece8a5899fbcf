//! The process pages: the list (filters kind, status, age; manual_review first) and one process
//! ([`mod@page`]: the [`strip`] of its steps first, overall and per-step status, the last classified error, attempts, operation ids,
//! external references, the [`timeline`] of transitions and operator actions, and the
//! [`actions`] allowed now that the user's role may ask for). Everything shown is redacted.

pub mod actions;
pub mod page;
pub mod strip;
pub mod timeline;
pub mod values;

use super::badge::badge;
use super::errors::error_page;
use super::layout::{page, shown};
use super::session::WebSession;
use crate::error::ConsoleError;
use crate::redact;
use crate::state::AppState;
use crate::targets::processes::ProcessFilter;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::{Value, json};
use values::{txt, when};

/// The list's query, as the filter form sends it.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    kind: Option<String>,
    status: Option<String>,
    /// Text from the form: empty for any age.
    older_than_seconds: Option<String>,
}

/// `GET /processes`.
pub async fn list_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(q): Query<ListQuery>,
) -> Response {
    let older = q
        .older_than_seconds
        .as_deref()
        .map(str::trim)
        .filter(|o| !o.is_empty());
    let older_than_seconds = match older.map(str::parse::<i64>) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => {
            return error_page(
                Some(&session),
                &ConsoleError::BadRequest("older than: a number of seconds".into()),
            );
        }
    };
    let filter = ProcessFilter {
        kind: q.kind.clone().filter(|k| !k.is_empty()),
        status: q.status.clone().filter(|k| !k.is_empty()),
        older_than_seconds,
        limit: Some(200),
    };
    if let Err(e) = filter.check() {
        return error_page(Some(&session), &e);
    }
    let list = match s.processes.list(&s.pool, &filter).await {
        Ok(l) => l,
        Err(e) => return error_page(Some(&session), &e),
    };
    let body = html! {
        form method="get" id="process-filter" {
            "kind " input name="kind" value=(shown(q.kind.as_deref().unwrap_or("")));
            " status " select name="status" id="filter-status" { (status_options(q.status.as_deref())) }
            " older than " input name="older_than_seconds" value=(shown(older.unwrap_or(""))) size="6";
            " s "
            button id="filter" { "Filter" }
        }
        p { "Processes in manual review first, then the most recently changed." }
        table #processes {
            tr {
                th { "process" } th { "kind" } th { "business key" } th { "status" } th { "attempt" }
                th { "created" } th { "updated" } th { "last change" } th { "version" }
            }
            @for p in list.iter().map(redact::value) { (row(&p)) }
        }
        @if list.is_empty() { p #no-processes { "No process matches." } }
    };
    page(Some(&session), "Processes", body).into_response()
}

/// One process of the list.
fn row(p: &Value) -> Markup {
    let id = txt(p, "id");
    let status = txt(p, "status");
    html! {
        tr class={ "process status-" (status) } {
            td { a href={ "/processes/" (id) } id={ "process-" (id) } { code { (id) } } }
            td { (shown(&txt(p, "kind"))) " v" (shown(&txt(p, "definition_version"))) }
            td { (shown(&txt(p, "business_key"))) }
            td.status { (badge(&status)) @if p["paused"] == json!(true) { " " (badge("paused")) } }
            td { (shown(&txt(p, "attempt"))) }
            td { (when(p, "created_at")) }
            td { (when(p, "updated_at")) }
            td { (shown(&txt(p, "last_actor"))) ": " (shown(&txt(p, "last_reason"))) }
            td { (shown(&txt(p, "version"))) }
        }
    }
}

/// The status filter's options, `selected` chosen.
fn status_options(selected: Option<&str>) -> Markup {
    use processes::ProcessStatus as S;
    // Manual review first: what an operator looks for.
    const STATUSES: [S; 9] = [
        S::ManualReview,
        S::Pending,
        S::Running,
        S::Waiting,
        S::Compensating,
        S::Succeeded,
        S::Failed,
        S::Compensated,
        S::Cancelled,
    ];
    html! {
        option value="" { "any" }
        @for st in STATUSES { option selected[selected == Some(st.as_str())] { (st.as_str()) } }
    }
}
