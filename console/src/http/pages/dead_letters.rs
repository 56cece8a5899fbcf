//! A consumer's dead letters (of the consumers in `CONSOLE_CONSUMERS`), with the replay form for
//! a role that may replay; and that form's handler.

use super::errors::{answer_page, error_page};
use super::forms::{Fields, csrf, field, hidden, notice_redirect_to, submit};
use super::layout::{page, shown};
use super::overview::plan_page;
use super::session::WebSession;
use crate::actions::{Action, allowed};
use crate::auth::sessions::Session;
use crate::state::AppState;
use crate::targets::dead_letters;
use crate::text::url_encode;
use axum::Form;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::json;

/// The page's query: which consumer.
#[derive(Debug, Deserialize)]
pub struct ConsumerQuery {
    consumer: Option<String>,
}

/// `GET /dead-letters`: the consumer form and links, and the chosen consumer's dead letters.
pub async fn dead_letters_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(q): Query<ConsumerQuery>,
) -> Response {
    let chosen = q.consumer.as_deref().filter(|c| !c.is_empty());
    let letters = match chosen {
        Some(c) => {
            // Not in CONSOLE_CONSUMERS: a 404, like the API's.
            if let Err(e) = dead_letters::listed(&s.settings.consumers, c) {
                return error_page(Some(&session), &e);
            }
            Some(dead_letters::list(&s.settings.amqp_url, &s.settings.amqp_tls, c, 200).await)
        }
        None => None,
    };
    let body = html! {
        form method="get" {
            label { "Consumer " input type="text" name="consumer"; }
            " " button { "Show" }
        }
        @if !s.settings.consumers.is_empty() {
            p {
                @for c in &s.settings.consumers {
                    a href={ "/dead-letters?consumer=" (shown(c)) } { (shown(c)) } " "
                }
            }
        }
        @match (chosen, letters) {
            (Some(c), Some(Ok(letters))) => (letters_form(&session, c, &letters)),
            (_, Some(Err(e))) => p.error { (shown(&e.public_message())) },
            _ => {},
        }
    };
    page(Some(&session), "Consumer dead letters", body).into_response()
}

/// The dead letters of `consumer`, in the replay form when the user's role may replay.
fn letters_form(session: &Session, consumer: &str, letters: &[dead_letters::Letter]) -> Markup {
    let may = allowed(session.principal.role, Action::DlqReplay);
    let table = html! {
        table #dead-letters {
            tr {
                th {} th { "message id" } th { "event" } th { "kind" } th { "reason" }
                th { "attempts" } th { "dead-lettered at" } th { "payload" }
            }
            @for l in letters {
                tr {
                    td {
                        @if let (Some(id), true) = (&l.message_id, may) {
                            input type="checkbox" name="item" value={ (shown(id)) "|" (shown(&l.version)) };
                        }
                    }
                    td {
                        (shown(l.message_id.as_deref().unwrap_or("")))
                        @if let Some(agg) = l.headers["aggregate_id"].as_str() {
                            br; a.aggregate href=(super::links::Links::messages(agg)) { "events of " (shown(agg)) }
                        }
                    }
                    td { (shown(&l.event_type)) }
                    td { (shown(&l.kind)) }
                    td { (shown(&l.reason)) }
                    td { @if let Some(a) = l.attempts { (a) } }
                    td { (shown(l.dead_lettered_at.as_deref().unwrap_or(""))) }
                    td { code { (shown(&l.payload.to_string())) } }
                }
            }
        }
    };
    if !may {
        return table;
    }
    html! {
        form method="post" action={ "/ui/dead-letters/" (url_encode(consumer)) "/replay" } {
            (hidden(session))
            (table)
            label { "Reason " input type="text" name="reason"; }
            " " button name="dry_run" value="1" { "Dry run" }
            " " button name="go" value="1" { "Replay selected" }
        }
    }
}

/// `POST /ui/dead-letters/{consumer}/replay`: the checked letters (`item` = `ID|VERSION`), or
/// their dry run.
pub async fn replay(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(consumer): Path<String>,
    Form(f): Form<Fields>,
) -> Response {
    if let Err(r) = csrf(&s, &session, &f, Action::DlqReplay.name()).await {
        return r;
    }
    let items: Vec<dead_letters::Item> = f
        .iter()
        .filter(|(k, _)| k == "item")
        .filter_map(|(_, v)| v.split_once('|'))
        .map(|(id, ver)| dead_letters::Item {
            message_id: id.to_string(),
            version: ver.to_string(),
        })
        .collect();
    let dry_run = field(&f, "dry_run").is_some();
    let body = json!({
        "reason": field(&f, "reason").unwrap_or(""),
        "items": items,
        "dry_run": dry_run,
    });
    let path = format!("/api/dead-letters/{}/actions/replay", url_encode(&consumer));
    match submit(&s, &session, &f, &path, body).await {
        (status, v) if status.is_success() && dry_run => plan_page(&session, &v),
        (status, v) if status.is_success() => notice_redirect_to("/", &v),
        (status, v) => answer_page(&session, status, &v),
    }
}
