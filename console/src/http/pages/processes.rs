//! The process pages: the list (filters kind, status, age; manual_review first) and one process
//! (overall and per-step status, the last classified error, attempts, operation ids, external
//! references, the timeline of transitions and operator actions, and a form for each action
//! allowed now that the user's role may ask for). Everything shown is redacted.

use super::{
    Fields, NoticeQuery, WebSession, answer_page, approvals_table, audit_table_with_id, csrf,
    error_page, esc, field, hidden, html, notice_redirect_to, page, submit, url_encode,
};
use crate::actions::approvals;
use crate::actions::audit;
use crate::actions::{Action, allowed};
use crate::auth::roles::Role;
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::redact;
use crate::state::AppState;
use crate::targets::processes::{ConsoleWords, ProcessFilter};
use axum::Form;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use processes::admin::ActionKind;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashMap;
use uuid::Uuid;

/// A value of `v` as text ("" for null or missing).
fn txt(v: &Value, key: &str) -> String {
    match v.get(key) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn time_of(v: &Value, key: &str) -> Option<DateTime<Utc>> {
    v.get(key)
        .and_then(|t| t.as_str())
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc))
}

/// A time as shown (UTC, to the second).
fn when(v: &Value, key: &str) -> String {
    time_of(v, key)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_default()
}

/// A time in a crowded table: the time of day, the whole time on hover.
fn short(v: &Value, key: &str) -> String {
    time_of(v, key)
        .map(|t| {
            format!(
                "<span title=\"{}\">{}</span>",
                t.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
                t.format("%H:%M:%S")
            )
        })
        .unwrap_or_default()
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    kind: Option<String>,
    status: Option<String>,
    /// Text from the form: empty for any age.
    older_than_seconds: Option<String>,
}

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
    let v = |o: &Option<String>| esc(o.as_deref().unwrap_or(""));
    let mut h = format!(
        "<form method=\"get\" id=\"process-filter\">kind <input name=\"kind\" value=\"{}\"> \
         status <select name=\"status\" id=\"filter-status\">{}</select> \
         older than <input name=\"older_than_seconds\" value=\"{}\" size=\"6\"> s \
         <button id=\"filter\">Filter</button></form>\
         <p>Processes in manual review first, then the most recently changed.</p>",
        v(&q.kind),
        status_options(q.status.as_deref()),
        esc(older.unwrap_or("")),
    );
    h.push_str(
        "<table id=\"processes\"><tr><th>process</th><th>kind</th><th>business key</th><th>status</th>\
         <th>attempt</th><th>created</th><th>updated</th><th>last change</th><th>version</th></tr>",
    );
    for p in list.iter().map(redact::value) {
        let id = txt(&p, "id");
        let status = txt(&p, "status");
        let paused = if p["paused"] == json!(true) {
            " (paused)"
        } else {
            ""
        };
        h.push_str(&format!(
            "<tr class=\"process status-{status_class}\"><td><a href=\"/processes/{id}\" id=\"process-{id}\"><code>{id}</code></a></td>\
             <td>{} v{}</td><td>{}</td><td class=\"status\"><b>{}</b>{paused}</td><td>{}</td><td>{}</td><td>{}</td><td>{}: {}</td><td>{}</td></tr>",
            esc(&txt(&p, "kind")),
            esc(&txt(&p, "definition_version")),
            esc(&txt(&p, "business_key")),
            esc(&status),
            esc(&txt(&p, "attempt")),
            when(&p, "created_at"),
            when(&p, "updated_at"),
            esc(&txt(&p, "last_actor")),
            esc(&txt(&p, "last_reason")),
            esc(&txt(&p, "version")),
            id = html(&id),
            status_class = html(&status),
        ));
    }
    h.push_str("</table>");
    if list.is_empty() {
        h.push_str("<p id=\"no-processes\">No process matches.</p>");
    }
    page(Some(&session), "Processes", &h).into_response()
}

fn status_options(selected: Option<&str>) -> String {
    let mut h = String::from("<option value=\"\">any</option>");
    for st in [
        "manual_review",
        "pending",
        "running",
        "waiting",
        "compensating",
        "succeeded",
        "failed",
        "compensated",
        "cancelled",
    ] {
        h.push_str(&format!(
            "<option{}>{st}</option>",
            if selected == Some(st) {
                " selected"
            } else {
                ""
            }
        ));
    }
    h
}

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
    let mut h = notice.html();
    h.push_str(&summary(&v));
    h.push_str(&last_error(&v));
    h.push_str(&unknown_outcomes(&v));
    h.push_str(&format!(
        "<h2>Input</h2><p><code id=\"input\">{}</code></p>",
        esc(&v["input"].to_string())
    ));
    h.push_str(&steps_table(&steps));
    h.push_str(&actions(session, id, &v, &steps, &pending));
    if !pending.is_empty() {
        h.push_str("<h2>Approval requests</h2>");
        h.push_str(&approvals_table(
            session,
            &pending,
            Some(&format!("/processes/{id}")),
        ));
    }
    if !entries.is_empty() {
        h.push_str("<h2>Operator actions</h2>");
        h.push_str(&audit_table_with_id("process-audit", &entries));
    }
    h.push_str(&timeline(&v, &steps, &entries));
    h.push_str("<p><a href=\"/processes\">All processes</a></p>");
    let title = format!("Process {} {}", txt(&v, "kind"), txt(&v, "business_key"));
    Ok(page(Some(session), &title, &h).into_response())
}

fn summary(v: &Value) -> String {
    let row = |k: &str, val: String| format!("<tr><th>{k}</th><td>{val}</td></tr>");
    let mut h = String::from("<table id=\"process\">");
    h.push_str(&row("id", format!("<code>{}</code>", esc(&txt(v, "id")))));
    h.push_str(&row(
        "kind",
        format!(
            "{} (definition v{})",
            esc(&txt(v, "kind")),
            esc(&txt(v, "definition_version"))
        ),
    ));
    h.push_str(&row("business key", esc(&txt(v, "business_key"))));
    let revision = match txt(v, "revision_of").as_str() {
        "" => esc(&txt(v, "revision")),
        of => format!(
            "{} (revises <a href=\"/processes/{o}\">{o}</a>)",
            esc(&txt(v, "revision")),
            o = html(of)
        ),
    };
    h.push_str(&row("revision", revision));
    let paused = if v["paused"] == json!(true) {
        " <b>paused</b>"
    } else {
        ""
    };
    h.push_str(&row(
        "status",
        format!(
            "<b id=\"process-status\">{}</b>{paused}",
            esc(&txt(v, "status"))
        ),
    ));
    h.push_str(&row("attempt", esc(&txt(v, "attempt"))));
    h.push_str(&row(
        "version",
        format!(
            "<span id=\"process-version\">{}</span>",
            esc(&txt(v, "version"))
        ),
    ));
    h.push_str(&row(
        "times",
        format!(
            "created {} · updated {} · finished {} · deadline {}",
            when(v, "created_at"),
            when(v, "updated_at"),
            when(v, "finished_at"),
            when(v, "deadline_at")
        ),
    ));
    let lease = match txt(v, "lease_owner").as_str() {
        "" => "none".to_string(),
        owner => format!("{} until {}", esc(owner), when(v, "lease_until")),
    };
    h.push_str(&row("lease", lease));
    h.push_str(&row(
        "last change",
        format!(
            "{}: {}",
            esc(&txt(v, "last_actor")),
            esc(&txt(v, "last_reason"))
        ),
    ));
    h.push_str("</table>");
    h
}

fn last_error(v: &Value) -> String {
    let e = &v["last_error"];
    if e.is_null() {
        return "<p id=\"last-error\">No step has a classified error.</p>".into();
    }
    format!(
        "<p id=\"last-error\">Last classified error: <b>{}</b> at step {} {} ({}), {}: {}</p>",
        esc(&txt(e, "class")),
        esc(&txt(e, "step")),
        esc(&txt(e, "name")),
        esc(&txt(e, "role")),
        when(e, "at"),
        esc(&txt(e, "message"))
    )
}

/// The steps whose outcome is unknown, above everything else one could do: the remote may have
/// acted, and the safe action for its capability.
fn unknown_outcomes(v: &Value) -> String {
    let doubts = v["unknown_outcomes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut h = String::new();
    for d in &doubts {
        let step = txt(d, "step");
        let safe = match d["safe_action"]
            .as_str()
            .and_then(crate::targets::processes::parse_action)
        {
            Some(a) => format!("Safe action first: <b>{}</b> (below).", esc(a.label())),
            None => "No safe action: the remote can neither deduplicate nor be queried. \
                     Look it up at the remote and record what you checked and its answer."
                .to_string(),
        };
        h.push_str(&format!(
            "<div class=\"warning\" id=\"unknown-outcome-{}\"><b>The remote may have acted</b> \
             (step {} {}, remote {}): {} {safe}</div>",
            html(&step),
            esc(&step),
            esc(&txt(d, "name")),
            esc(&txt(d, "remote")),
            esc(&txt(d, "warning")),
        ));
    }
    h
}

fn steps_table(steps: &[Value]) -> String {
    let mut h = String::from(
        "<h2>Steps</h2><table id=\"steps\"><tr><th>#</th><th>step</th><th>role</th><th>runs</th><th>status</th>\
         <th>attempts</th><th>error</th><th>operation id</th><th>external references</th><th>times</th><th>last change</th></tr>",
    );
    for st in steps {
        let seq = txt(st, "seq");
        let role = match txt(st, "acts_on").as_str() {
            "" => esc(&txt(st, "role")),
            on => format!("{} of #{}", esc(&txt(st, "role")), esc(on)),
        };
        let runs = match txt(st, "remote").as_str() {
            "" => esc(&txt(st, "execution")),
            remote => format!("{} ({})", esc(&txt(st, "execution")), esc(remote)),
        };
        let sensitive = if st["sensitive"] == json!(true) {
            " <small>sensitive</small>"
        } else {
            ""
        };
        let error = match txt(st, "error_class").as_str() {
            "" => String::new(),
            class => format!("<b>{}</b>: {}", esc(class), esc(&txt(st, "error_message"))),
        };
        let refs = [("remote", "remote_ref"), ("result", "result_ref")]
            .iter()
            .filter(|(_, k)| !txt(st, k).is_empty())
            .map(|(label, k)| format!("{label}: <code>{}</code>", esc(&txt(st, k))))
            .collect::<Vec<_>>()
            .join("<br>");
        let times = [
            ("first", "first_attempt_at"),
            ("last", "last_attempt_at"),
            ("next", "next_attempt_at"),
            ("finished", "finished_at"),
        ]
        .iter()
        .filter(|(_, k)| time_of(st, k).is_some())
        .map(|(label, k)| format!("{label} {}", short(st, k)))
        .collect::<Vec<_>>()
        .join("<br>");
        h.push_str(&format!(
            "<tr class=\"step\" id=\"step-{seq}\"><td>{seq}</td><td class=\"name\">{}{sensitive}</td><td class=\"role\">{role}</td><td>{runs}</td>\
             <td class=\"status\" id=\"step-{seq}-status\">{}</td><td>{}/{}</td><td>{error}</td><td><code>{}</code></td><td>{refs}</td><td>{times}</td><td>{}: {}</td></tr>",
            esc(&txt(st, "name")),
            esc(&txt(st, "status")),
            esc(&txt(st, "attempts")),
            esc(&txt(st, "max_attempts")),
            esc(&txt(st, "operation_id")),
            esc(&txt(st, "last_actor")),
            esc(&txt(st, "last_reason")),
            seq = html(&seq),
        ));
    }
    h.push_str("</table>");
    h
}

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

/// "name (role)" of each step, by its seq.
fn step_names(steps: &[Value]) -> HashMap<String, String> {
    steps
        .iter()
        .map(|st| {
            (
                txt(st, "seq"),
                format!("{} ({})", txt(st, "name"), txt(st, "role")),
            )
        })
        .collect()
}

/// A form per action allowed now that the user may ask for; the others are named with the role
/// they need.
fn actions(
    session: &Session,
    id: Uuid,
    v: &Value,
    steps: &[Value],
    requests: &[approvals::Approval],
) -> String {
    let role = session.principal.role;
    let offered = v["allowed_actions"].as_array().cloned().unwrap_or_default();
    let version = txt(v, "version");
    let names = step_names(steps);
    let mut h = String::from("<h2>Actions allowed now</h2><div id=\"actions\">");
    if offered.is_empty() {
        h.push_str(&format!(
            "<p id=\"no-actions\">None: the process is {}.</p>",
            esc(&txt(v, "status"))
        ));
    }
    for o in &offered {
        let Some(action) = o["action"]
            .as_str()
            .and_then(crate::targets::processes::parse_action)
        else {
            continue;
        };
        let step = txt(o, "step");
        let on = names
            .get(&step)
            .map(|n| format!(" step {} {}", esc(&step), esc(n)))
            .unwrap_or_default();
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
            h.push_str(&format!(
                "<p class=\"action-pending\" id=\"pending-{slug}\">{}{on}: waiting for approval \
                 (request <a href=\"#approval-{}\">{}</a> by {})</p>",
                esc(action.label()),
                waiting.id,
                waiting.id,
                esc(&waiting.requested_by)
            ));
            continue;
        }
        if !allowed(role, Action::Process(action)) {
            h.push_str(&format!(
                "<p class=\"action-unavailable\" id=\"offered-{slug}\">{}{on}: needs the {} role</p>",
                esc(action.label()),
                Action::Process(action).min_role()
            ));
            continue;
        }
        let mut evidence = String::new();
        if o["needs_evidence"] == json!(true) {
            evidence.push_str(&format!(
                " <label>Evidence <input type=\"text\" name=\"evidence\" id=\"evidence-{slug}\" placeholder=\"provider reference, ticket\"></label>"
            ));
        }
        if o["needs_remote_check"] == json!(true) {
            evidence.push_str(&format!(
                " <label>Checked at the remote <input type=\"text\" name=\"checked\" id=\"checked-{slug}\" placeholder=\"where, by which reference\"></label> \
                 <label>Its answer <input type=\"text\" name=\"answer\" id=\"answer-{slug}\" placeholder=\"what the remote said\"></label>"
            ));
        }
        let safe = if o["safe_for_unknown_outcome"] == json!(true) {
            " <small class=\"safe\">safe for an unknown outcome</small>"
        } else {
            ""
        };
        let label = match (action, o["needs_approval"] == json!(true)) {
            (ActionKind::ResolveFailed, true) => "Request resolve as failed",
            _ => action.label(),
        };
        let step_field = if step.is_empty() {
            String::new()
        } else {
            format!(
                "<input type=\"hidden\" name=\"step\" value=\"{}\">",
                html(&step)
            )
        };
        h.push_str(&format!(
            "<form method=\"post\" action=\"/ui/processes/{id}/actions/{name}\" class=\"process-action\" id=\"form-{slug}\">{}\
             <input type=\"hidden\" name=\"version\" value=\"{}\">{step_field}\
             <b>{}</b>{on}{safe} <small>{}</small><br>\
             <label>Reason <input type=\"text\" name=\"reason\" id=\"reason-{slug}\"></label>{evidence} \
             <button id=\"action-{slug}\">{}</button></form>",
            hidden(session),
            html(&version),
            esc(label),
            esc(explain(action)),
            esc(label),
            name = action.name(),
        ));
    }
    if role == Role::Viewer && !offered.is_empty() {
        h.push_str("<p>Viewers read only.</p>");
    }
    h.push_str("</div>");
    h
}

/// Transitions (the processes crate's history) and console actions (the audit log), by time.
fn timeline(v: &Value, steps: &[Value], entries: &[audit::Entry]) -> String {
    let names = step_names(steps);
    let mut rows: Vec<(DateTime<Utc>, u8, i64, String)> = Vec::new();
    for t in v["history"].as_array().into_iter().flatten() {
        let at = time_of(t, "at").unwrap_or(DateTime::<Utc>::MIN_UTC);
        let what = match txt(t, "step_seq").as_str() {
            "" => "process".to_string(),
            seq => format!(
                "step {} {}",
                esc(seq),
                esc(names.get(seq).map(String::as_str).unwrap_or(""))
            ),
        };
        let from = txt(t, "from_status");
        rows.push((
            at,
            0,
            t["id"].as_i64().unwrap_or(0),
            format!(
                "<tr class=\"timeline-transition\"><td>{}</td><td>transition</td><td>{what}</td><td>{}{}</td><td>{}</td><td>{}</td><td></td></tr>",
                at.format("%Y-%m-%d %H:%M:%S%.3f"),
                if from.is_empty() { String::new() } else { format!("{} → ", esc(&from)) },
                esc(&txt(t, "to_status")),
                esc(&txt(t, "actor")),
                esc(&txt(t, "reason")),
            ),
        ));
    }
    for e in entries {
        let approver = e
            .approver
            .as_deref()
            .map(|a| format!("approver {}", esc(a)))
            .unwrap_or_default();
        rows.push((
            e.at,
            1,
            e.seq,
            format!(
                "<tr class=\"timeline-action audit-entry\"><td>{}</td><td>console</td><td>{}</td><td class=\"outcome\">{}</td><td>{} ({})</td><td>{}</td><td>{approver}</td></tr>",
                e.at.format("%Y-%m-%d %H:%M:%S%.3f"),
                esc(&e.action),
                esc(&e.outcome),
                esc(&e.actor_name),
                esc(&e.roles.join(",")),
                esc(&e.reason),
            ),
        ));
    }
    rows.sort_by_key(|r| (r.0, r.1, r.2));
    let mut h = String::from(
        "<h2>Timeline</h2><table id=\"timeline\"><tr><th>when (UTC)</th><th>source</th><th>what</th><th>change / outcome</th><th>who</th><th>reason</th><th></th></tr>",
    );
    for (_, _, _, row) in rows {
        h.push_str(&row);
    }
    h.push_str("</table>");
    h
}

/// A form's action on a process: CSRF, then the API route as the session's user.
pub async fn process_action(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path((id, name)): Path<(Uuid, String)>,
    Form(f): Form<Fields>,
) -> Response {
    let Some(action) = crate::targets::processes::parse_action(&name) else {
        return error_page(
            Some(&session),
            &ConsoleError::NotFound(format!("process action {name:?}")),
        );
    };
    if let Err(r) = csrf(&s, &session, &f, action.audit_name()).await {
        return r;
    }
    let Some(version) = field(&f, "version").and_then(|v| v.parse::<i64>().ok()) else {
        return error_page(
            Some(&session),
            &ConsoleError::BadRequest("version missing".into()),
        );
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
    match submit(&s, &session, &f, &path, body).await {
        (status, v) if status.is_success() => notice_redirect_to(&format!("/processes/{id}"), &v),
        (status, v) => answer_page(&session, status, &v),
    }
}
