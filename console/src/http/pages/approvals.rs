//! Approval requests as cards, in the approver's terms (what runs, on what, asked by whom), with
//! approve and reject forms for an approver who did not ask; and those forms' handlers.

use super::forms::{Fields, answered, csrf_and_version, field, hidden, submit};
use super::layout::shown;
use super::session::WebSession;
use crate::actions::{Action, allowed, approvals};
use crate::auth::sessions::Session;
use crate::state::AppState;
use crate::text::url_encode;
use axum::Form;
use axum::extract::{Path, State};
use axum::response::Response;
use maud::{Markup, html};
use serde_json::{Value, json};
use uuid::Uuid;

/// Approval requests, with approve and reject forms for an approver who did not make them;
/// `back`: the page to return to after a decision (a process page), else the overview.
pub fn approvals_table(
    session: &Session,
    list: &[approvals::Approval],
    back: Option<&str>,
) -> Markup {
    html! {
        div #approvals {
            @if list.is_empty() { p { "None." } }
            @for a in list { (card(session, a, back)) }
        }
    }
}

/// One request: title, status, terms, who asked, the decision form, the request as stored.
fn card(session: &Session, a: &approvals::Approval, back: Option<&str>) -> Markup {
    let p = &session.principal;
    let may_decide = allowed(p.role, Action::ApprovalApprove);
    let id = a.id;
    html! {
        div.approval.card id={ "approval-" (id) } {
            p {
                b { (shown(&approval_title(a))) } " · " span.status { (super::badge::badge(&a.status)) }
                @match (&a.decided_by, a.status.as_str()) {
                    (Some(by), _) => { " by " (shown(by)) },
                    (None, "superseded") => {
                        " (what it was about changed since the request: nothing ran; ask again if still needed)"
                    },
                    _ => {},
                }
            }
            (approval_terms(a))
            p {
                "Asked by " b { (shown(&a.requested_by)) } " at "
                (a.requested_at.format("%Y-%m-%d %H:%M:%S")) ": " (shown(&a.reason))
            }
            @if let Some(r) = &a.result { p { "Result: " code { (shown(&r.to_string())) } } }
            @if a.status == "pending" && may_decide && a.requested_by != p.name {
                form method="post" action={ "/ui/approvals/" (id) "/approve" } {
                    (hidden(session))
                    @if let Some(b) = back { input type="hidden" name="back" value=(b); }
                    input type="hidden" name="version" value=(a.version);
                    input type="text" name="reason" id={ "approval-reason-" (id) } placeholder="reason" required;
                    " " button id={ "approve-" (id) } { "Approve" }
                    " " button formaction={ "/ui/approvals/" (id) "/reject" } id={ "reject-" (id) } { "Reject" }
                }
            } @else if a.status == "pending" {
                "waiting for another approver"
            }
            details { summary { "request as stored" } code { (shown(&a.request.to_string())) } }
        }
    }
}

/// What an approval does, in words.
fn approval_title(a: &approvals::Approval) -> String {
    let r = &a.request;
    let n = r["items"].as_array().map(Vec::len).unwrap_or(0);
    match r["kind"].as_str() {
        Some("outbox_requeue") => format!("Requeue {n} dead outbox rows"),
        Some("dlq_replay") => format!(
            "Replay {n} dead letters of {}",
            r["consumer"].as_str().unwrap_or("?")
        ),
        Some("ordered_discard") => {
            let what = if r["discard"] == json!("run") {
                "Dead-letter everything held"
            } else {
                "Skip the head"
            };
            format!(
                "{what} of {}/{} (ordered consumer {})",
                r["aggregate_type"].as_str().unwrap_or("?"),
                r["aggregate_id"].as_str().unwrap_or("?"),
                r["consumer"].as_str().unwrap_or("?")
            )
        }
        Some("process_bulk") => {
            let action = r["action"].as_str().unwrap_or("?").replace('_', " ");
            match r["step"].as_str() {
                Some(step) => format!("{action} of step {step} on {n} processes a filter selected"),
                None => format!("{action} on {n} processes a filter selected"),
            }
        }
        Some("process") => {
            let step = &r["request"]["step"];
            let what = match r["action"].as_str() {
                Some("run_compensation") => "Run the compensation (e.g. a refund)",
                Some("resolve_succeeded") => "Resolve as succeeded",
                Some("resolve_failed") => "Resolve as failed (the outcome was unknown)",
                _ => "Process action",
            };
            if step.is_null() {
                what.to_string()
            } else {
                format!("{what}: step {step}")
            }
        }
        _ => a.action.clone(),
    }
}

/// A process request in business terms: amount and currency, order, customer, payment, the
/// process as it is now (status, version) with a link, and the evidence given.
fn approval_terms(a: &approvals::Approval) -> Markup {
    if a.request["kind"] == json!("ordered_discard") {
        return ordered_terms(&a.request);
    }
    if a.request["kind"] == json!("process_bulk") {
        return bulk_terms(&a.request);
    }
    if a.request["kind"] == json!("outbox_requeue") || a.request["kind"] == json!("dlq_replay") {
        return selection_terms(&a.request);
    }
    let Some(p) = &a.process else {
        return html! {};
    };
    let input = &p["input"];
    let field = |k: &str| {
        input.get(k).filter(|v| !v.is_null()).map(|v| {
            v.as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string())
        })
    };
    let s = |v: &Value| shown(v.as_str().unwrap_or(""));
    let mut terms: Vec<Markup> = Vec::new();
    // Amounts are minor units (cents): shown in major units by the currency's ISO 4217
    // exponent, with the stored figure beside them, so the approver reads 63.96 EUR, not 6396.
    for m in crate::money::of_process(p) {
        terms.push(html! {
            (shown(&m.field)) " " b.amount { (shown(&m.shown)) }
            @if let Some(minor) = m.minor { " " small { "(" (minor) " minor units)" } }
            @if !m.declared { " " small { "(read by convention: the definition declares no money)" } }
        });
    }
    for (label, key) in [
        ("order", "order_id"),
        ("customer", "customer_id"),
        ("payment", "payment_id"),
        ("tenant", "tenant"),
    ] {
        if let Some(v) = field(key) {
            terms.push(html! { (label) " " code { (shown(&v)) } });
        }
    }
    terms.push(html! {
        "process " a href={ "/processes/" (p["id"].as_str().unwrap_or("")) } {
            (s(&p["kind"])) " " (s(&p["business_key"]))
        }
        ", now " b { (s(&p["status"])) }
        @if p["paused"] == json!(true) { " (paused)" }
        " at version " (shown(&p["version"].to_string()))
        " (asked at version " (shown(&a.request["request"]["version"].to_string())) ")"
    });
    let req = &a.request["request"];
    if let Some(e) = req["evidence"].as_str() {
        terms.push(html! { "evidence " code { (shown(e)) } });
    }
    if let Some(c) = req.get("remote_check").filter(|c| c.is_object()) {
        terms.push(html! {
            "checked at the remote: " (s(&c["checked"])) "; its answer: " (s(&c["answer"]))
        });
    }
    html! {
        p.terms {
            @for (i, t) in terms.iter().enumerate() {
                @if i > 0 { " · " }
                (t)
            }
        }
    }
}

/// The dead rows or letters a requeue or replay request names, each with the version it acts
/// on; a dead row links to its page (its event type, headers, payload, error and history).
fn selection_terms(r: &Value) -> Markup {
    let items = r["items"].as_array().cloned().unwrap_or_default();
    let rows = r["kind"] == json!("outbox_requeue");
    html! {
        ul.selection {
            @for i in items.iter().take(50) {
                @let id = i["id"].as_str().or(i["message_id"].as_str()).unwrap_or("");
                @let version = i["version"].as_str().map(str::to_string).unwrap_or_else(|| i["version"].to_string());
                li {
                    @if rows { a.selected-row href={ "/outbox/dead/" (shown(id)) } { code { (shown(id)) } } }
                    @else { code { (shown(id)) } }
                    " at version " (shown(&version))
                }
            }
            @if items.len() > 50 { li { "and " (items.len() - 50) " more (the request as stored lists them all)" } }
        }
    }
}

/// The processes a bulk request froze, in the approver's terms: the filter as asked (a link to
/// the list it selects now) and each process with the version it is acted on at, linked.
fn bulk_terms(r: &Value) -> Markup {
    let filter: Vec<(String, String)> = r["filter"]
        .as_object()
        .map(|f| {
            f.iter()
                .filter_map(|(k, v)| {
                    let v = v
                        .as_str()
                        .map(str::to_string)
                        .or_else(|| (v.is_number() || v.is_boolean()).then(|| v.to_string()))?;
                    (!v.trim().is_empty()).then(|| (k.clone(), v))
                })
                .collect()
        })
        .unwrap_or_default();
    let query = filter
        .iter()
        .map(|(k, v)| format!("{k}={}", crate::text::url_encode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let items = r["items"].as_array().cloned().unwrap_or_default();
    html! {
        p.terms {
            "filter "
            @for (i, (k, v)) in filter.iter().enumerate() {
                @if i > 0 { ", " }
                code { (shown(k)) "=" (shown(v)) }
            }
            " · " a.bulk-filter href={ "/processes?" (query) } { "what it selects now" }
            " · acts only on these processes at these versions (one that moved on is skipped):"
        }
        ul.bulk-items {
            @for item in &items {
                @let id = item["id"].as_str().unwrap_or("");
                li { a href={ "/processes/" (id) } { code { (shown(id)) } } " at version " (shown(&item["version"].to_string())) }
            }
        }
    }
}

/// A skip or dead-lettered run in the approver's terms: the aggregate and the position seen, and
/// each message it dead-letters (number, event, payload as it was when asked), or the missing
/// number it passes over.
fn ordered_terms(r: &Value) -> Markup {
    let consumer = r["consumer"].as_str().unwrap_or("");
    let s = |v: &Value| shown(v.as_str().unwrap_or(""));
    let messages = r["messages"].as_array().cloned().unwrap_or_default();
    html! {
        p.terms {
            "consumer " a href={ "/consumers/" (url_encode(consumer)) "/ordered" } { (shown(consumer)) }
            " · aggregate " code { (s(&r["aggregate_type"])) "/" (s(&r["aggregate_id"])) }
            " · applied up to " b { (shown(&r["version"].to_string())) } " when asked"
        }
        @if messages.is_empty() {
            p.warning {
                "Passes over the missing message "
                (r["version"].as_i64().map(|v| v + 1).unwrap_or_default())
                ": it will never be applied if it arrives later."
            }
        } @else {
            p.warning { "These messages will be dead-lettered: their effects are not applied." }
            table {
                tr { th { "seq" } th { "event" } th { "payload" } }
                @for m in &messages {
                    tr {
                        td { (shown(&m["aggregate_seq"].to_string())) }
                        td { (s(&m["event_type"])) }
                        td { code { (shown(&m["payload"].to_string())) } }
                    }
                }
            }
        }
    }
}

/// A decision form's action: CSRF, then the API route as the session's user; back to the page
/// the form was on.
async fn decide(s: AppState, session: Session, id: Uuid, f: Fields, approve: bool) -> Response {
    let action = Action::decision(approve);
    let version: i32 = match csrf_and_version(&s, &session, &f, action.name()).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let verb = if approve { "approve" } else { "reject" };
    let body = json!({"reason": field(&f, "reason").unwrap_or(""), "version": version});
    // Back to the page the form was on: the overview, or a process page.
    let back = field(&f, "back")
        .and_then(back_page)
        .unwrap_or_else(|| "/".to_string());
    let path = format!("/api/approvals/{id}/{verb}");
    answered(&session, &back, submit(&s, &session, &f, &path, body).await)
}

/// The console page a decision form may return to: a process page or an ordered consumer's page
/// (rebuilt from what it names, so no form can send the browser elsewhere).
fn back_page(back: &str) -> Option<String> {
    if let Some(id) = back.strip_prefix("/processes/") {
        return id.parse::<Uuid>().ok().map(|id| format!("/processes/{id}"));
    }
    let consumer = back.strip_prefix("/consumers/")?.strip_suffix("/ordered")?;
    let plain = !consumer.is_empty()
        && consumer
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    plain.then(|| format!("/consumers/{consumer}/ordered"))
}

/// `POST /ui/approvals/{id}/approve`.
pub async fn approve(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(id): Path<Uuid>,
    Form(f): Form<Fields>,
) -> Response {
    decide(s, session, id, f, true).await
}

/// `POST /ui/approvals/{id}/reject`.
pub async fn reject(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(id): Path<Uuid>,
    Form(f): Form<Fields>,
) -> Response {
    decide(s, session, id, f, false).await
}
