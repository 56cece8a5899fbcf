//! Acting on every process the list's filters select (issue 23, item 7), from the list page: a
//! form under the list (for a role that may ask) sends the filters, the action, its step and one
//! reason to `POST /api/processes/actions/{action}` (the same path as the API); "Dry run" shows
//! the processes it selects now with their versions, "Request approval" freezes them in one
//! approval request (see `crate::targets::processes::bulk`).

use super::super::errors::error_page;
use super::super::forms::{Fields, answered, csrf, field, hidden, submit};
use super::super::layout::{page, shown};
use super::super::session::WebSession;
use crate::actions::{Action, allowed};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::processes::{BULK_OFFERED, parse_action};
use crate::text::url_encode;
use axum::Form;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde_json::{Map, Value, json};

/// The filter fields a bulk request carries (the list's, without its cursor).
const FILTERS: [&str; 9] = [
    "q",
    "kind",
    "status",
    "paused",
    "step",
    "error_class",
    "remote",
    "in_review_longer_than",
    "older_than_seconds",
];

/// The form under the list: the filters as hidden fields, the action, its step, a reason.
/// Nothing for a role that may not ask for any bulk action.
pub fn bulk_form(session: &Session, filters: &[(&str, &str)], total: i64) -> Markup {
    let offered: Vec<&str> = BULK_OFFERED
        .iter()
        .filter(|k| allowed(session.principal.role, Action::Process(**k)))
        .map(|k| k.name())
        .collect();
    if offered.is_empty() || total == 0 {
        return html! {};
    }
    let step = filters
        .iter()
        .find(|(k, _)| *k == "step")
        .map(|(_, v)| *v)
        .unwrap_or("");
    html! {
        form method="post" action="/ui/processes/bulk" id="bulk-form" {
            (hidden(session))
            @for (k, v) in filters { input type="hidden" name=(format!("filter_{k}")) value=(shown(v)); }
            "Act on all " b #bulk-total { (super::super::paging::thousands(total)) } " that match: "
            select name="action" id="bulk-action" { @for a in &offered { option { (a) } } }
            " step " input name="step" id="bulk-step" size="10" value=(shown(step));
            " reason " input name="reason" id="bulk-reason" size="30" required;
            " " button name="dry_run" value="1" id="bulk-dry-run" { "Dry run" }
            " " button name="go" value="1" id="bulk-submit" { "Request approval" }
            " " small { "one approval for all of them; a process that changes meanwhile is skipped" }
        }
    }
}

/// The request body the form's fields make.
fn body_of(f: &Fields, dry_run: bool) -> Value {
    let mut filter = Map::new();
    for k in FILTERS {
        if let Some(v) = field(f, &format!("filter_{k}")).filter(|v| !v.is_empty()) {
            let v = match k {
                "older_than_seconds" => v.parse::<i64>().map(Value::from).unwrap_or(json!(v)),
                _ => json!(v),
            };
            filter.insert(k.into(), v);
        }
    }
    json!({
        "filter": filter,
        "step": field(f, "step").filter(|s| !s.is_empty()),
        "reason": field(f, "reason").unwrap_or(""),
        "dry_run": dry_run,
    })
}

/// `POST /ui/processes/bulk`: the dry run's page, or the approval request.
pub async fn bulk(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Form(f): Form<Fields>,
) -> Response {
    let name = field(&f, "action").unwrap_or("");
    let Some(action) = parse_action(name) else {
        return error_page(
            Some(&session),
            &ConsoleError::NotFound(format!("process action {name:?}")),
        );
    };
    if let Err(r) = csrf(&s, &session, &f, Action::Process(action).name()).await {
        return r;
    }
    let dry_run = field(&f, "dry_run").is_some();
    let path = format!("/api/processes/actions/{}", url_encode(action.name()));
    match submit(&s, &session, &f, &path, body_of(&f, dry_run)).await {
        (status, v) if status.is_success() && dry_run => plan_page(&session, &f, &v),
        answer => answered(&session, "/", answer),
    }
}

/// The dry run: every process selected now with its version and whether the action is allowed
/// on it, and the same form to request the approval.
fn plan_page(session: &Session, f: &Fields, v: &Value) -> Response {
    let items = v["items"].as_array().cloned().unwrap_or_default();
    let filters: Vec<(&str, &str)> = FILTERS
        .iter()
        .filter_map(|k| {
            field(f, &format!("filter_{k}"))
                .filter(|v| !v.is_empty())
                .map(|v| (*k, v))
        })
        .collect();
    let body = html! {
        p #bulk-summary {
            (shown(v["action"].as_str().unwrap_or(""))) " on " b #bulk-selected { (v["selected"]) }
            " of " (v["matching"]) " matching processes (the others do not allow it now)."
        }
        table #bulk-plan {
            tr { th { "process" } th { "business key" } th { "status" } th { "version" } th { "selected" } }
            @for i in &items {
                @let id = i["id"].as_str().unwrap_or("");
                tr.bulk-item {
                    td { a href={ "/processes/" (id) } { code { (id) } } }
                    td { (shown(i["business_key"].as_str().unwrap_or(""))) }
                    td { (shown(i["status"].as_str().unwrap_or(""))) }
                    td { (i["version"]) }
                    td { @if i["allowed"] == json!(true) { "yes" } @else { (shown(i["why_not"].as_str().unwrap_or("no"))) } }
                }
            }
        }
        form method="post" action="/ui/processes/bulk" id="bulk-form" {
            (hidden(session))
            @for (k, v) in &filters { input type="hidden" name=(format!("filter_{k}")) value=(shown(v)); }
            input type="hidden" name="action" value=(shown(field(f, "action").unwrap_or("")));
            input type="hidden" name="step" value=(shown(field(f, "step").unwrap_or("")));
            " reason " input name="reason" id="bulk-reason" size="30" required value=(shown(field(f, "reason").unwrap_or("")));
            " " button name="go" value="1" id="bulk-submit" { "Request approval" }
        }
        p { a href="/processes" { "Processes" } }
    };
    page(Some(session), "Dry run", body).into_response()
}
