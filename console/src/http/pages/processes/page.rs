//! One process's page: the summary, the last classified error, the steps whose outcome is
//! unknown (above all else), what it waits for, the input, the steps, the actions allowed now, pending approval
//! requests, operator actions and the timeline.

use super::actions::actions;
use super::strip::strip;
use super::timeline::timeline;
use super::values::{short, time_of, txt, when};
use crate::actions::{approvals, audit};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::http::pages::approvals::approvals_table;
use crate::http::pages::audit::audit_table;
use crate::http::pages::badge::badge;
use crate::http::pages::errors::error_page;
use crate::http::pages::layout::{page, shown};
use crate::http::pages::links::Links;
use crate::http::pages::notice::NoticeQuery;
use crate::http::pages::session::WebSession;
use crate::redact;
use crate::state::AppState;
use crate::targets::processes::{ConsoleWords, parse_action};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use processes::StepStatus;
use serde_json::{Value, json};
use std::collections::HashMap;
use uuid::Uuid;

/// `GET /processes/{id}`.
pub async fn process_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(id): Path<Uuid>,
    Query(n): Query<NoticeQuery>,
) -> Response {
    match render(&s, &session, id, &n).await {
        Ok(r) => r,
        Err(e) => error_page(Some(&session), &e),
    }
}

async fn render(
    s: &AppState,
    session: &Session,
    id: Uuid,
    notice: &NoticeQuery,
) -> Result<Response, ConsoleError> {
    let Some(view) = s.processes.get(&s.pool, id).await? else {
        return Err(ConsoleError::NotFound(format!("process {id}")));
    };
    let v = redact::value(&view);
    let pending = approvals::of_process(&s.pool, s, id).await?;
    let entries = audit::of_process(&s.pool, &s.schema, id).await?;
    let steps: Vec<Value> = v["steps"].as_array().cloned().unwrap_or_default();
    let labels: HashMap<i32, String> = processes::look::compensation_labels(&s.pool, &s.schema, id)
        .await?
        .into_iter()
        .collect();
    let links = Links::new(&s.settings.look);
    let body = html! {
        (notice.html())
        (strip(&v, &entries, &labels))
        (summary(&v, &links))
        (last_error(&v))
        (unknown_outcomes(&v))
        (waits(&steps))
        h2 { "Input" }
        (money_lines(&v))
        p { code #input { (shown(&v["input"].to_string())) } }
        (steps_table(&steps, &labels, &links))
        (actions(session, id, &v, &steps, &pending))
        @if !pending.is_empty() {
            h2 { "Approval requests" }
            (approvals_table(session, &pending, Some(&format!("/processes/{id}"))))
        }
        @if !entries.is_empty() {
            h2 { "Operator actions" }
            (audit_table("process-audit", &entries))
        }
        details #history {
            summary #history-toggle { b { "Full history" } " (" (v["history"].as_array().map(Vec::len).unwrap_or(0)) " transitions and " (entries.len()) " console actions, by time)" }
            (timeline(&v, &steps, &entries))
        }
        p { a href="/processes" { "All processes" } }
    };
    let title = format!("Process {} {}", txt(&v, "kind"), txt(&v, "business_key"));
    Ok(page(Some(session), &title, body).into_response())
}

/// The process at a glance: id, kind, key, revision, status, attempt, version, times, lease,
/// last change, and what it names (its business key's and input's outbox messages, its trace).
/// The input's amounts in major units above the input as stored (where they are minor units).
fn money_lines(v: &Value) -> Markup {
    let amounts = crate::money::of_process(v);
    html! {
        @if !amounts.is_empty() {
            ul #input-money {
                @for m in &amounts { li { (shown(&m.line())) } }
            }
            p { small { "The input as stored; its amounts are in minor units:" } }
        }
    }
}

fn summary(v: &Value, links: &Links) -> Markup {
    let t = |k: &str| shown(&txt(v, k));
    html! {
        table #process {
            tr { th { "id" } td { code { (t("id")) } } }
            tr { th { "kind" } td { (t("kind")) " (definition v" (t("definition_version")) ")" } }
            tr {
                th { "business key" }
                td { a #business-key href=(Links::messages(&txt(v, "business_key"))) { (t("business_key")) } }
            }
            @let amounts = crate::money::of_process(v);
            @if !amounts.is_empty() {
                tr {
                    th { "money" }
                    td #process-money {
                        @for (i, m) in amounts.iter().enumerate() {
                            @if i > 0 { " · " }
                            (shown(&m.field)) " " b.amount { (shown(&m.shown)) }
                        }
                    }
                }
            }
            tr {
                th { "revision" }
                td {
                    (t("revision"))
                    @let of = txt(v, "revision_of");
                    @if !of.is_empty() { " (revises " a href={ "/processes/" (of) } { (of) } ")" }
                }
            }
            tr {
                th { "status" }
                td {
                    span #process-status { (badge(&txt(v, "status"))) }
                    @if v["paused"] == json!(true) { " " (badge("paused")) }
                }
            }
            tr { th { "attempt" } td { (t("attempt")) } }
            tr { th { "version" } td { span #process-version { (t("version")) } } }
            tr {
                th { "times" }
                td {
                    "created " (when(v, "created_at")) " · updated " (when(v, "updated_at"))
                    " · finished " (when(v, "finished_at")) " · deadline " (when(v, "deadline_at"))
                }
            }
            tr {
                th { "lease" }
                td {
                    @match txt(v, "lease_owner").as_str() {
                        "" => "none",
                        owner => { (shown(owner)) " until " (when(v, "lease_until")) },
                    }
                }
            }
            tr { th { "last change" } td { (t("last_actor")) ": " (t("last_reason")) } }
            (related(v, links))
        }
    }
}

/// The things the process names: the outbox messages of its business key and of the ids in its
/// input (an order, a payment), its trace when the input carries a traceparent.
fn related(v: &Value, links: &Links) -> Markup {
    let input = &v["input"];
    let ids: Vec<(&str, String)> = [("order", "order_id"), ("payment", "payment_id")]
        .into_iter()
        .filter_map(|(label, k)| input[k].as_str().map(|id| (label, shown(id))))
        .collect();
    let trace = input["traceparent"].as_str().and_then(|tp| links.trace(tp));
    html! {
        tr {
            th { "related" }
            td #related {
                a href=(Links::messages(&txt(v, "business_key"))) { "outbox messages of " (shown(&txt(v, "business_key"))) }
                @for (label, id) in &ids {
                    " · " a.related href=(Links::messages(id)) id={ "related-" (label) } { (label) " " code { (id) } " and its messages" }
                }
                @if let Some((id, url)) = trace {
                    " · " a #trace href=(url) { "trace " code { (id) } }
                }
            }
        }
    }
}

/// The last classified error of any step, or that there is none.
fn last_error(v: &Value) -> Markup {
    let e = &v["last_error"];
    if e.is_null() {
        return html! { p #last-error { "No step has a classified error." } };
    }
    let t = |k: &str| shown(&txt(e, k));
    html! {
        p #last-error {
            "Last classified error: " b { (t("class")) } " at step " (t("step")) " " (t("name"))
            " (" (t("role")) "), " (when(e, "at")) ": " (t("message"))
        }
    }
}

/// The steps whose outcome is unknown, above everything else one could do: the remote may have
/// acted, and the safe action for its capability.
fn unknown_outcomes(v: &Value) -> Markup {
    let doubts = v["unknown_outcomes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    html! {
        @for d in &doubts {
            @let step = txt(d, "step");
            div.warning id={ "unknown-outcome-" (step) } {
                b { "The remote may have acted" }
                " (step " (shown(&step)) " " (shown(&txt(d, "name"))) ", remote " (shown(&txt(d, "remote")))
                "): " (shown(&txt(d, "warning"))) " "
                @match d["safe_action"].as_str().and_then(parse_action) {
                    Some(a) => { "Safe action first: " b { (a.label()) } " (below)." },
                    None => {
                        "No safe action: the remote can neither deduplicate nor be queried. \
                         Look it up at the remote and record what you checked and its answer."
                    },
                }
            }
        }
    }
}

/// What the process waits for, if it is parked at a wait or a timer: the awaited event's key,
/// since when, the deadline and what happens then (a queryable remote is asked; otherwise manual
/// review), or when a timer continues. Waiting holds nothing: no lease, no worker.
fn waits(steps: &[Value]) -> Markup {
    let parked = steps.iter().filter(|st| st["parked"] == json!(true));
    html! {
        @for st in parked {
            @let seq = txt(st, "seq");
            @let until = time_of(st, "wait_until");
            @let left = until.map(|u| relative(u - chrono::Utc::now())).unwrap_or_default();
            div.waiting id={ "wait-" (seq) } {
                @if txt(st, "execution") == "timer" {
                    b { "Timer" } " (step " (shown(&seq)) " " (shown(&txt(st, "name"))) "): continues at "
                    (when(st, "wait_until")) " (" (left) "), set " (when(st, "wait_since")) "."
                } @else {
                    b { "Waiting for event " code.wait-key { (shown(&txt(st, "wait_key"))) } }
                    " (step " (shown(&seq)) " " (shown(&txt(st, "name"))) ") since "
                    (when(st, "wait_since")) "; deadline " (when(st, "wait_until")) " (" (left) "). "
                    @if txt(st, "status") == StepStatus::Retryable.as_str() {
                        "The remote's status query found no outcome yet; next query "
                        (when(st, "next_attempt_at")) ". "
                    }
                    @if txt(st, "remote") == "queryable" {
                        "At the deadline the remote is queried; query it now below if you cannot wait."
                    } @else {
                        "The remote cannot be queried: at the deadline the step goes to manual review."
                    }
                }
            }
        }
    }
}

/// A duration from now, as humantime writes it, to the second ("in 4m 12s", "12s ago").
fn relative(d: chrono::TimeDelta) -> String {
    let secs = d.num_seconds();
    let span = humantime::format_duration(std::time::Duration::from_secs(secs.unsigned_abs()));
    if secs >= 0 {
        format!("in {span}")
    } else {
        format!("{span} ago")
    }
}

/// The steps: role, how each runs, status, attempts, error, operation id, references, times.
fn steps_table(steps: &[Value], labels: &HashMap<i32, String>, links: &Links) -> Markup {
    html! {
        h2 { "Steps" }
        table #steps {
            tr {
                th { "#" } th { "step" } th { "role" } th { "runs" } th { "status" } th { "attempts" }
                th { "error" } th { "operation id" } th { "external references" } th { "times" }
                th { "last change" }
            }
            @for st in steps { (step_row(st, labels, links)) }
        }
    }
}

/// One step of [`steps_table`].
fn step_row(st: &Value, labels: &HashMap<i32, String>, links: &Links) -> Markup {
    let t = |k: &str| shown(&txt(st, k));
    let seq = txt(st, "seq");
    let refs: Vec<(&str, String)> = [("remote", "remote_ref"), ("result", "result_ref")]
        .into_iter()
        .filter(|(_, k)| !txt(st, k).is_empty())
        .map(|(label, k)| (label, t(k)))
        .collect();
    let times: Vec<(&str, &str)> = [
        ("first", "first_attempt_at"),
        ("last", "last_attempt_at"),
        ("next", "next_attempt_at"),
        ("finished", "finished_at"),
    ]
    .into_iter()
    .filter(|(_, k)| time_of(st, k).is_some())
    .collect();
    html! {
        tr.step id={ "step-" (seq) } {
            td { (seq) }
            td.name {
                @if let Some(l) = st["seq"].as_i64().and_then(|q| labels.get(&(q as i32))) {
                    b.compensation-label { (shown(l)) } " (" (t("name")) ")"
                } @else { (t("name")) }
                @if st["sensitive"] == json!(true) { " " small { "sensitive" } }
            }
            td.role {
                (t("role"))
                @let on = txt(st, "acts_on");
                @if !on.is_empty() { " of #" (shown(&on)) }
            }
            td {
                (t("execution"))
                @let remote = txt(st, "remote");
                @if !remote.is_empty() { " (" (shown(&remote)) ")" }
            }
            td.status id={ "step-" (seq) "-status" } { (badge(&txt(st, "status"))) }
            td { (t("attempts")) "/" (t("max_attempts")) }
            td {
                @let class = txt(st, "error_class");
                @if !class.is_empty() { b { (shown(&class)) } ": " (t("error_message")) }
            }
            td { code { (t("operation_id")) } }
            td {
                @for (i, (label, r)) in refs.iter().enumerate() {
                    @if i > 0 { br; }
                    (label) ": "
                    @match (*label, links.remote(r)) {
                        ("remote", Some(url)) => { a.remote-ref href=(url) { code { (r) } } },
                        _ => { code { (r) } },
                    }
                }
            }
            td {
                @for (i, (label, k)) in times.iter().enumerate() {
                    @if i > 0 { br; }
                    (label) " " (short(st, k))
                }
            }
            td { (t("last_actor")) ": " (t("last_reason")) }
        }
    }
}
