//! The ordered consumers' page: for each consumer of `CONSOLE_CONSUMERS` that runs in ordered
//! mode, a strip of its partitions (one box per partition, coloured by the instance that holds
//! it, grey when nobody does) and its stuck aggregates as cards: why it is stuck, since when, the
//! first held messages (redacted), and the forms the user's role may use (retry now; ask for a
//! skip or a dead-lettered run, which an approver confirms). Everything shown is redacted.

use super::{
    Fields, NoticeQuery, WebSession, answer_page, approvals_table, csrf, error_page, esc, field,
    hidden, html, notice_redirect_to, page, submit, url_encode,
};
use crate::actions::approvals;
use crate::actions::{Action, allowed};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::ordered::{self, ConsumerView, OrderedAction, StuckView};
use axum::Form;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A stable colour per instance name (so one instance's partitions read as one block).
fn colour(owner: &str) -> String {
    let hash = owner
        .bytes()
        .fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619));
    format!("hsl({}, 55%, 72%)", hash % 360)
}

fn strip(v: &ConsumerView) -> String {
    let mut h = String::from("<div class=\"partitions\" id=\"partitions\">");
    for p in &v.partitions {
        let (fill, who) = match (&p.owner, p.live) {
            (Some(o), true) => (colour(o), esc(o)),
            (Some(o), false) => ("#ddd".to_string(), format!("{} (lease ended)", esc(o))),
            (None, _) => ("#ddd".to_string(), "nobody".to_string()),
        };
        let stuck = if p.held > 0 { " held" } else { "" };
        h.push_str(&format!(
            "<div class=\"partition{stuck}\" style=\"background:{fill}\" title=\"partition {n}: {who}, epoch {e}, {a} aggregates, {held} held\">\
             <b>{n}</b><br><small>{who}</small><br><small>{a} agg · {held} held</small></div>",
            n = p.partition,
            e = p.epoch,
            a = p.aggregates,
            held = p.held,
        ));
    }
    h.push_str("</div>");
    h
}

fn action_form(
    session: &Session,
    consumer: &str,
    s: &StuckView,
    action: OrderedAction,
    label: &str,
    note: &str,
) -> String {
    let dry_run = if action.needs_approval() {
        "<button name=\"dry_run\" value=\"1\">Dry run</button> "
    } else {
        ""
    };
    format!(
        "<form method=\"post\" class=\"process-action\" action=\"/ui/consumers/{c}/ordered/{a}\">{}\
         <input type=\"hidden\" name=\"aggregate_type\" value=\"{t}\"><input type=\"hidden\" name=\"aggregate_id\" value=\"{i}\">\
         <input type=\"hidden\" name=\"version\" value=\"{v}\">\
         <label>Reason <input type=\"text\" name=\"reason\" id=\"reason-{a}-{id}\"></label> {dry_run}\
         <button name=\"go\" value=\"1\" id=\"{a}-{id}\">{label}</button> <small>{note}</small></form>",
        hidden(session),
        c = html(&url_encode(consumer)),
        a = action.as_str(),
        t = html(&s.aggregate_type),
        i = html(&s.aggregate_id),
        v = s.version,
        id = html(&url_encode(&format!(
            "{}/{}",
            s.aggregate_type, s.aggregate_id
        ))),
    )
}

fn card(session: &Session, consumer: &str, s: &StuckView) -> String {
    let why = match s.kind.as_str() {
        "parked" => format!(
            "<b>parked</b> after {} attempt(s): <code>{}</code>",
            s.attempts,
            esc(s.reason.as_deref().unwrap_or(""))
        ),
        _ => format!(
            "<b>waiting for message {}</b>: it has not arrived (on its way, dead in the outbox, or dead-lettered)",
            s.version + 1
        ),
    };
    let mut h = format!(
        "<div class=\"card stuck\" id=\"stuck-{}\"><p><code>{}/{}</code> · applied up to <b>{}</b> · {} held · since {}</p><p>{why}</p>",
        html(&url_encode(&format!(
            "{}/{}",
            s.aggregate_type, s.aggregate_id
        ))),
        esc(&s.aggregate_type),
        esc(&s.aggregate_id),
        s.version,
        s.held,
        esc(&s.since),
    );
    h.push_str("<table><tr><th>seq</th><th>message id</th><th>event</th><th>payload</th></tr>");
    for m in &s.first_held {
        h.push_str(&format!(
            "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td><code>{}</code></td></tr>",
            m.aggregate_seq,
            esc(&m.message_id),
            esc(&m.event_type),
            esc(&m.payload.to_string())
        ));
    }
    h.push_str("</table>");
    let role = session.principal.role;
    if s.kind == "parked" && allowed(role, Action::Ordered(OrderedAction::Retry)) {
        h.push_str(&action_form(
            session,
            consumer,
            s,
            OrderedAction::Retry,
            "Retry the head now",
            "after fixing the cause; nothing is discarded",
        ));
    }
    if allowed(role, Action::Ordered(OrderedAction::Skip)) {
        h.push_str(&action_form(
            session,
            consumer,
            s,
            OrderedAction::Skip,
            "Ask to skip the head",
            "dead-letters it (or passes a missing number over): an approver must confirm",
        ));
        h.push_str(&action_form(
            session,
            consumer,
            s,
            OrderedAction::DeadLetterRun,
            "Ask to dead-letter everything held",
            "an approver must confirm",
        ));
    }
    h.push_str("</div>");
    h
}

/// `GET /consumers/{consumer}/ordered`.
pub async fn page_of(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(consumer): Path<String>,
    Query(notice): Query<NoticeQuery>,
) -> Response {
    let view = async {
        crate::targets::dead_letters::listed(&s.settings.consumers, &consumer)?;
        let v = ordered::view(&s.pool, &s.schema, &consumer, s.settings.ordered_gap_after).await?;
        let pending = approvals::list(&s.pool, &s, Some("pending")).await?;
        Ok::<_, ConsoleError>((v, pending))
    }
    .await;
    let (v, pending) = match view {
        Ok(x) => x,
        Err(e) => return error_page(Some(&session), &e),
    };
    let mut h = notice.html();
    h.push_str(&format!(
        "<p id=\"ordered-counts\">parked <b>{}</b> · waiting for a gap <b>{}</b> · held messages <b>{}</b></p><h2>Partitions</h2>",
        v.parked, v.gap_waits, v.held
    ));
    h.push_str(&strip(&v));
    h.push_str("<h2>Stuck aggregates</h2>");
    if v.stuck.is_empty() {
        h.push_str("<p id=\"no-stuck\">None: every aggregate is flowing.</p>");
    }
    for st in &v.stuck {
        h.push_str(&card(&session, &consumer, st));
    }
    let prefix = format!("ordered:{consumer}/");
    let mine: Vec<approvals::Approval> = pending
        .into_iter()
        .filter(|a| a.target.as_deref().is_some_and(|t| t.starts_with(&prefix)))
        .collect();
    h.push_str("<h2>Approval requests on this consumer</h2>");
    h.push_str(&approvals_table(
        &session,
        &mine,
        Some(&format!("/consumers/{}/ordered", url_encode(&consumer))),
    ));
    page(Some(&session), &format!("Ordered consumer {consumer}"), &h).into_response()
}

/// `GET /ordered`: the consumers of `CONSOLE_CONSUMERS`, each linked.
pub async fn index(State(s): State<AppState>, WebSession(session): WebSession) -> Response {
    let mut h = String::from("<ul id=\"ordered-consumers\">");
    for c in &s.settings.consumers {
        h.push_str(&format!(
            "<li><a href=\"/consumers/{}/ordered\">{}</a></li>",
            html(&url_encode(c)),
            esc(c)
        ));
    }
    h.push_str("</ul><p>A consumer that never ran in ordered mode has no page (404).</p>");
    page(Some(&session), "Ordered consumers", &h).into_response()
}

/// A form's action on a stuck aggregate: CSRF, then the API route as the session's user.
pub async fn action(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path((consumer, name)): Path<(String, String)>,
    Form(f): Form<Fields>,
) -> Response {
    let action: OrderedAction = match name.parse() {
        Ok(a) => a,
        Err(e) => return error_page(Some(&session), &e),
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
    let dry_run = field(&f, "dry_run").is_some();
    let body = json!({
        "aggregate_type": field(&f, "aggregate_type").unwrap_or(""),
        "aggregate_id": field(&f, "aggregate_id").unwrap_or(""),
        "version": version,
        "reason": field(&f, "reason").unwrap_or(""),
        "dry_run": dry_run,
    });
    let back = format!("/consumers/{}/ordered", url_encode(&consumer));
    let path = format!(
        "/api/consumers/{}/ordered/actions/{}",
        url_encode(&consumer),
        action.as_str()
    );
    match submit(&s, &session, &f, &path, body).await {
        (status, v) if status.is_success() && dry_run => {
            let h = format!(
                "<p>Would dead-letter: <b id=\"would-dead-letter\">{}</b> (an empty list passes a missing number over)</p>\
                 <p><code>{}</code></p><p>Running it asks an approver.</p><p><a href=\"{}\">Back</a></p>",
                esc(&v["would_dead_letter"].to_string()),
                esc(&v["messages"].to_string()),
                html(&back)
            );
            page(Some(&session), "Dry run", &h).into_response()
        }
        (status, v) if status.is_success() => notice_redirect_to(&back, &v),
        (status, v) => answer_page(&session, status, &v),
    }
}
