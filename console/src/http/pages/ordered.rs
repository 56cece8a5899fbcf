//! The ordered consumers' page: for each consumer of `CONSOLE_CONSUMERS` that runs in ordered
//! mode, a strip of its partitions (one box per partition, coloured by the instance that holds
//! it, grey when nobody does) and its stuck aggregates as cards: why it is stuck, since when, the
//! first held messages (redacted), and the forms the user's role may use (retry now; ask for a
//! skip or a dead-lettered run, which an approver confirms). Everything shown is redacted.

use super::approvals::approvals_table;
use super::errors::error_page;
use super::forms::{Fields, answered, csrf_and_version, field, hidden, submit};
use super::layout::{page, shown};
use super::notice::NoticeQuery;
use super::session::WebSession;
use crate::actions::{Action, allowed, approvals};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::ordered::{self, ConsumerView, OrderedAction, StuckView};
use crate::text::url_encode;
use axum::Form;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde_json::json;

/// A stable colour per instance name (so one instance's partitions read as one block).
fn colour(owner: &str) -> String {
    let hash = owner
        .bytes()
        .fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619));
    format!("hsl({}, 55%, 72%)", hash % 360)
}

/// The partitions, one box each.
fn strip(v: &ConsumerView) -> Markup {
    html! {
        div.partitions #partitions {
            @for p in &v.partitions {
                @let (fill, who) = match (&p.owner, p.live) {
                    (Some(o), true) => (colour(o), shown(o)),
                    (Some(o), false) => ("#ddd".to_string(), format!("{} (lease ended)", shown(o))),
                    (None, _) => ("#ddd".to_string(), "nobody".to_string()),
                };
                div class={ "partition" @if p.held > 0 { " held" } } style={ "background:" (fill) }
                    title={ "partition " (p.partition) ": " (who) ", epoch " (p.epoch) ", " (p.aggregates)
                            " aggregates, " (p.held) " held" } {
                    b { (p.partition) } br;
                    small { (who) } br;
                    small { (p.aggregates) " agg · " (p.held) " held" }
                }
            }
        }
    }
}

/// The HTML id part of a stuck aggregate: `type/id`, percent-encoded.
fn slug(s: &StuckView) -> String {
    url_encode(&format!("{}/{}", s.aggregate_type, s.aggregate_id))
}

/// A form asking for `action` on the stuck aggregate `s`.
fn action_form(
    session: &Session,
    consumer: &str,
    s: &StuckView,
    action: OrderedAction,
    label: &str,
    note: &str,
) -> Markup {
    let a = action.as_str();
    let id = slug(s);
    html! {
        form method="post" class="process-action"
            action={ "/ui/consumers/" (url_encode(consumer)) "/ordered/" (a) } {
            (hidden(session))
            input type="hidden" name="aggregate_type" value=(s.aggregate_type);
            input type="hidden" name="aggregate_id" value=(s.aggregate_id);
            input type="hidden" name="version" value=(s.version);
            label { "Reason " input type="text" name="reason" id={ "reason-" (a) "-" (id) } required; }
            " "
            @if action.needs_approval() { button name="dry_run" value="1" { "Dry run" } " " }
            button name="go" value="1" id={ (a) "-" (id) } { (label) }
            " " small { (note) }
        }
    }
}

/// A stuck aggregate: why, since when, its first held messages, and the forms the role allows.
fn card(session: &Session, consumer: &str, s: &StuckView) -> Markup {
    let role = session.principal.role;
    html! {
        div.card.stuck id={ "stuck-" (slug(s)) } {
            p {
                code { (shown(&s.aggregate_type)) "/" (shown(&s.aggregate_id)) }
                " · applied up to " b { (s.version) } " · " (s.held) " held · since " (shown(&s.since))
            }
            p {
                @if s.kind == "parked" {
                    b { "parked" } " after " (s.attempts) " attempt(s): "
                    code { (shown(s.reason.as_deref().unwrap_or(""))) }
                } @else {
                    b { "waiting for message " (s.version + 1) }
                    ": it has not arrived (on its way, dead in the outbox, or dead-lettered)"
                }
            }
            table {
                tr { th { "seq" } th { "message id" } th { "event" } th { "payload" } }
                @for m in &s.first_held {
                    tr {
                        td { (m.aggregate_seq) }
                        td { code { (shown(&m.message_id)) } }
                        td { (shown(&m.event_type)) }
                        td { code { (shown(&m.payload.to_string())) } }
                    }
                }
            }
            @if s.kind == "parked" && allowed(role, Action::Ordered(OrderedAction::Retry)) {
                (action_form(session, consumer, s, OrderedAction::Retry, "Retry the head now",
                    "after fixing the cause; nothing is discarded"))
            }
            @if allowed(role, Action::Ordered(OrderedAction::Skip)) {
                (action_form(session, consumer, s, OrderedAction::Skip, "Ask to skip the head",
                    "dead-letters it (or passes a missing number over): an approver must confirm"))
                (action_form(session, consumer, s, OrderedAction::DeadLetterRun,
                    "Ask to dead-letter everything held", "an approver must confirm"))
            }
        }
    }
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
    let prefix = format!("ordered:{consumer}/");
    let mine: Vec<approvals::Approval> = pending
        .into_iter()
        .filter(|a| a.target.as_deref().is_some_and(|t| t.starts_with(&prefix)))
        .collect();
    let back = format!("/consumers/{}/ordered", url_encode(&consumer));
    let body = html! {
        (notice.html())
        p #ordered-counts {
            "parked " b { (v.parked) } " · waiting for a gap " b { (v.gap_waits) }
            " · held messages " b { (v.held) }
        }
        h2 { "Partitions" }
        (strip(&v))
        h2 { "Stuck aggregates" }
        @if v.stuck.is_empty() { p #no-stuck { "None: every aggregate is flowing." } }
        @for st in &v.stuck { (card(&session, &consumer, st)) }
        h2 { "Approval requests on this consumer" }
        (approvals_table(&session, &mine, Some(&back)))
    };
    page(
        Some(&session),
        &format!("Ordered consumer {consumer}"),
        body,
    )
    .into_response()
}

/// `GET /ordered`: the consumers of `CONSOLE_CONSUMERS`, each linked.
pub async fn index(State(s): State<AppState>, WebSession(session): WebSession) -> Response {
    let body = html! {
        ul #ordered-consumers {
            @for c in &s.settings.consumers {
                li { a href={ "/consumers/" (url_encode(c)) "/ordered" } { (shown(c)) } }
            }
        }
        p { "A consumer that never ran in ordered mode has no page (404)." }
    };
    page(Some(&session), "Ordered consumers", body).into_response()
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
    let version: i64 = match csrf_and_version(&s, &session, &f, action.audit_name()).await {
        Ok(v) => v,
        Err(r) => return r,
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
            let body = html! {
                p {
                    "Would dead-letter: " b #would-dead-letter { (shown(&v["would_dead_letter"].to_string())) }
                    " (an empty list passes a missing number over)"
                }
                p { code { (shown(&v["messages"].to_string())) } }
                p { "Running it asks an approver." }
                p { a href=(back) { "Back" } }
            };
            page(Some(&session), "Dry run", body).into_response()
        }
        answer => answered(&session, &back, answer),
    }
}
