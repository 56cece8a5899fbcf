//! `GET /processes`: the process list with one search box (process id, business key, order or
//! payment id, operation id, remote reference), filters, counts by status (each a link that
//! filters) and keyset pages with "showing 51–100 of 2,536" and a Next link. The same query as
//! `GET /api/processes` ([`ProcessQuery`]); a filter that is none is the error page (400).

use super::super::errors::error_page;
use super::super::layout::{page, shown};
use super::super::paging::{first_row, footer, thousands};
use super::super::session::WebSession;
use super::{row, status_options};
use crate::error::ConsoleError;
use crate::redact;
use crate::state::AppState;
use crate::targets::processes::ProcessQuery;
use crate::text::url_encode;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::Value;

/// The list's query, as the search form and the links send it (text: an empty field is no
/// filter).
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    q: Option<String>,
    kind: Option<String>,
    status: Option<String>,
    paused: Option<String>,
    step: Option<String>,
    error_class: Option<String>,
    remote: Option<String>,
    in_review_longer_than: Option<String>,
    older_than_seconds: Option<String>,
    after: Option<String>,
    /// The number of the page's first row (display only; the cursor decides the rows).
    from: Option<String>,
}

/// The page size.
const PAGE: i64 = 50;

impl ListQuery {
    /// The filters given, as (name, value), in the form's order (not the cursor).
    fn filters(&self) -> Vec<(&'static str, &str)> {
        [
            ("q", &self.q),
            ("kind", &self.kind),
            ("status", &self.status),
            ("paused", &self.paused),
            ("step", &self.step),
            ("error_class", &self.error_class),
            ("remote", &self.remote),
            ("in_review_longer_than", &self.in_review_longer_than),
            ("older_than_seconds", &self.older_than_seconds),
        ]
        .into_iter()
        .filter_map(|(k, v)| {
            v.as_deref()
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(|v| (k, v))
        })
        .collect()
    }

    /// The list's URL with these filters (the base of the Next link).
    fn base(&self) -> String {
        let q: Vec<String> = self
            .filters()
            .iter()
            .map(|(k, v)| format!("{k}={}", url_encode(v)))
            .collect();
        if q.is_empty() {
            "/processes".into()
        } else {
            format!("/processes?{}", q.join("&"))
        }
    }

    fn query(&self) -> Result<ProcessQuery, ConsoleError> {
        let older = self
            .older_than_seconds
            .as_deref()
            .map(str::trim)
            .filter(|o| !o.is_empty());
        let older_than_seconds = older
            .map(|o| {
                o.parse::<i64>()
                    .map_err(|_| ConsoleError::BadRequest("older than: a number of seconds".into()))
            })
            .transpose()?;
        Ok(ProcessQuery {
            q: self.q.clone(),
            kind: self.kind.clone(),
            status: self.status.clone(),
            paused: self.paused.clone(),
            step: self.step.clone(),
            error_class: self.error_class.clone(),
            remote: self.remote.clone(),
            in_review_longer_than: self.in_review_longer_than.clone(),
            older_than_seconds,
            after: self.after.clone(),
            limit: Some(PAGE),
        })
    }

    fn value(&self, field: &str) -> String {
        self.filters()
            .iter()
            .find(|(k, _)| *k == field)
            .map(|(_, v)| shown(v))
            .unwrap_or_default()
    }
}

/// `GET /processes`.
pub async fn list_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(q): Query<ListQuery>,
) -> Response {
    let found = async {
        let first = first_row(q.from.as_deref())?;
        let query = q.query()?.check()?;
        let found = s.processes.find(&s.pool, &query).await?;
        Ok::<_, ConsoleError>((first, redact::value(&found)))
    };
    let (first, found) = match found.await {
        Ok(f) => f,
        Err(e) => return error_page(Some(&session), &e),
    };
    let items = found["items"].as_array().cloned().unwrap_or_default();
    let body = html! {
        (search_form(&q))
        (counts(&found["counts"]))
        p { "Newest first. A search is an exact match on a process id, business key, order or payment id, operation id or remote reference." }
        table #processes {
            tr {
                th { "process" } th { "kind" } th { "business key" } th { "status" } th { "attempt" }
                th { "created" } th { "updated" } th { "last change" } th { "version" }
            }
            @for p in &items { (row(p)) }
        }
        @if items.is_empty() { p #no-processes { "No process matches." } }
        (footer(&q.base(), first, items.len(), found["total"].as_i64().unwrap_or(0), found["next"].as_str()))
        (super::bulk::bulk_form(&session, &q.filters(), found["total"].as_i64().unwrap_or(0)))
    };
    page(Some(&session), "Processes", body).into_response()
}

/// The search box and the filters, holding what was asked.
fn search_form(q: &ListQuery) -> Markup {
    html! {
        form method="get" id="process-filter" action="/processes" {
            input type="search" name="q" id="search" size="40" autofocus placeholder="process, business key, order, payment, operation id, remote ref" value=(q.value("q"));
            " status " select name="status" id="filter-status" { (status_options(q.status.as_deref())) }
            " kind " input name="kind" size="10" value=(q.value("kind"));
            " step " input name="step" id="filter-step" size="10" value=(q.value("step"));
            " error class " select name="error_class" id="filter-error-class" {
                (options(&["transient", "permanent", "unknown"], q.error_class.as_deref()))
            }
            " remote " select name="remote" id="filter-remote" {
                (options(&["honours_key", "queryable", "none"], q.remote.as_deref()))
            }
            " paused " select name="paused" id="filter-paused" { (options(&["true", "false"], q.paused.as_deref())) }
            " in review longer than " input name="in_review_longer_than" id="filter-review" size="5" placeholder="1h" value=(q.value("in_review_longer_than"));
            " older than " input name="older_than_seconds" value=(q.value("older_than_seconds")) size="6";
            " s "
            button id="filter" { "Find" }
        }
    }
}

/// `any` and each of `words`, `selected` chosen.
fn options(words: &[&str], selected: Option<&str>) -> Markup {
    html! {
        option value="" { "any" }
        @for w in words { option selected[selected == Some(*w)] { (w) } }
    }
}

/// How many processes have each status, each a link to the list filtered by it.
fn counts(counts: &Value) -> Markup {
    let counts = counts.as_array().cloned().unwrap_or_default();
    html! {
        p #status-counts {
            @for c in &counts {
                @let status = c["status"].as_str().unwrap_or("");
                a.count id={ "count-" (status) } href={ "/processes?status=" (url_encode(status)) } {
                    (status) " " b { (thousands(c["count"].as_i64().unwrap_or(0))) }
                }
                " "
            }
        }
    }
}
