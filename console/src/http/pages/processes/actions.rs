//! The actions a process offers now, as the page shows them: a form for each one the user's role
//! may ask for (with the evidence or remote check it needs), the others named with the role they
//! need, and one waiting for approval shown as such; and the forms' handler.

use super::values::{step_names, txt};
use crate::actions::allowed;
use crate::actions::{Action, approvals};
use crate::auth::roles::Role;
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::http::pages::errors::error_page;
use crate::http::pages::forms::{Fields, answered, csrf_and_version, field, hidden, submit};
use crate::http::pages::layout::shown;
use crate::http::pages::session::WebSession;
use crate::state::AppState;
use crate::targets::processes::{ConsoleWords, parse_action};
use crate::text::url_encode;
use axum::Form;
use axum::extract::{Path, State};
use axum::response::Response;
use maud::{Markup, html};
use processes::admin::ActionKind;
use serde_json::{Value, json};
use std::collections::HashMap;
use uuid::Uuid;

/// What each action does, next to its button.
fn explain(a: ActionKind) -> &'static str {
    match a {
        ActionKind::RerunStep => "the step runs again (it is idempotent, or did not run)",
        ActionKind::QueryRemote => {
            "a worker asks the remote by operation id whether the operation happened, before any new call"
        }
        ActionKind::Escalate => "automation stops; the process waits in manual review",
        ActionKind::Pause => "no worker takes the process until it is resumed",
        ActionKind::Resume => "workers take the process again",
        ActionKind::RunCompensation => {
            "the compensation runs (e.g. the refund); an approver must approve the request"
        }
        ActionKind::ResolveSucceeded => {
            "the step counts as done, on your evidence; a second approver must approve"
        }
        ActionKind::ResolveFailed => {
            "the step counts as failed: the process compensates its earlier effects \
             (for a step whose outcome is unknown: on what you checked at the remote, and a second approver must approve)"
        }
        ActionKind::Cancel => "the process stops without compensating",
    }
}

/// A form per action allowed now that the user may ask for; the others are named with the role
/// they need.
pub fn actions(
    session: &Session,
    id: Uuid,
    v: &Value,
    steps: &[Value],
    requests: &[approvals::Approval],
) -> Markup {
    let offered = v["allowed_actions"].as_array().cloned().unwrap_or_default();
    let names = step_names(steps);
    html! {
        h2 { "Actions allowed now" }
        div #actions {
            @if offered.is_empty() {
                p #no-actions { "None: the process is " (shown(&txt(v, "status"))) "." }
            }
            @for o in &offered { (offered_action(session, id, v, o, &names, requests)) }
            @if session.principal.role == Role::Viewer && !offered.is_empty() {
                p { "Viewers read only." }
            }
        }
    }
}

/// One offered action `o`: waiting for approval, out of the user's role, or its form.
fn offered_action(
    session: &Session,
    id: Uuid,
    v: &Value,
    o: &Value,
    names: &HashMap<String, String>,
    requests: &[approvals::Approval],
) -> Markup {
    let Some(action) = o["action"].as_str().and_then(parse_action) else {
        return html! {};
    };
    let step = txt(o, "step");
    let on = html! {
        @if let Some(n) = names.get(&step) { " step " (shown(&step)) " " (shown(n)) }
    };
    let slug = format!(
        "{}-{}",
        action.name(),
        if step.is_empty() { "process" } else { &step }
    );
    // One pending request per action: while it waits, no form asks again.
    if let Some(waiting) = requests
        .iter()
        .find(|a| a.status == "pending" && a.action == action.audit_name())
    {
        return html! {
            p.action-pending id={ "pending-" (slug) } {
                (action.label()) (on) ": waiting for approval (request "
                a href={ "#approval-" (waiting.id) } { (waiting.id) } " by " (shown(&waiting.requested_by)) ")"
            }
        };
    }
    if !allowed(session.principal.role, Action::Process(action)) {
        return html! {
            p.action-unavailable id={ "offered-" (slug) } {
                (action.label()) (on) ": needs the " (Action::Process(action).min_role()) " role"
            }
        };
    }
    let label = match (action, o["needs_approval"] == json!(true)) {
        (ActionKind::ResolveFailed, true) => "Request resolve as failed",
        _ => action.label(),
    };
    html! {
        form method="post" action={ "/ui/processes/" (id) "/actions/" (action.name()) }
            class="process-action" id={ "form-" (slug) } {
            (hidden(session))
            input type="hidden" name="version" value=(txt(v, "version"));
            @if !step.is_empty() { input type="hidden" name="step" value=(step); }
            b { (label) } (on)
            @if o["safe_for_unknown_outcome"] == json!(true) {
                " " small.safe { "safe for an unknown outcome" }
            }
            " " small { (explain(action)) } br;
            label { "Reason " input type="text" name="reason" id={ "reason-" (slug) } required; }
            (evidence_fields(o, &slug))
            " " button id={ "action-" (slug) } { (label) }
        }
    }
}

/// The fields an action needs besides a reason: evidence, or what was checked at the remote.
fn evidence_fields(o: &Value, slug: &str) -> Markup {
    html! {
        @if o["needs_evidence"] == json!(true) {
            " " label {
                "Evidence "
                input type="text" name="evidence" id={ "evidence-" (slug) } placeholder="provider reference, ticket";
            }
        }
        @if o["needs_remote_check"] == json!(true) {
            " " label {
                "Checked at the remote "
                input type="text" name="checked" id={ "checked-" (slug) } placeholder="where, by which reference";
            }
            " " label {
                "Its answer "
                input type="text" name="answer" id={ "answer-" (slug) } placeholder="what the remote said";
            }
        }
    }
}

/// A form's action on a process: CSRF, then the API route as the session's user.
pub async fn process_action(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path((id, name)): Path<(Uuid, String)>,
    Form(f): Form<Fields>,
) -> Response {
    let Some(action) = parse_action(&name) else {
        return error_page(
            Some(&session),
            &ConsoleError::NotFound(format!("process action {name:?}")),
        );
    };
    let version: i64 = match csrf_and_version(&s, &session, &f, action.audit_name()).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let mut body = json!({"reason": field(&f, "reason").unwrap_or(""), "version": version});
    if let Some(step) = field(&f, "step").and_then(|v| v.parse::<i32>().ok()) {
        body["step"] = json!(step);
    }
    if let Some(e) = field(&f, "evidence").filter(|e| !e.trim().is_empty()) {
        body["evidence"] = json!(e);
    }
    // Both or neither: one alone is sent as given, and refused with the rule's own message.
    let (checked, answer) = (field(&f, "checked"), field(&f, "answer"));
    if checked.is_some_and(|c| !c.trim().is_empty()) || answer.is_some_and(|a| !a.trim().is_empty())
    {
        body["remote_check"] =
            json!({"checked": checked.unwrap_or(""), "answer": answer.unwrap_or("")});
    }
    let path = format!("/api/processes/{id}/actions/{}", url_encode(action.name()));
    let back = format!("/processes/{id}");
    answered(&session, &back, submit(&s, &session, &f, &path, body).await)
}
