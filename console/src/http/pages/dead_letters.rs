//! A consumer's dead letters (of the consumers in `CONSOLE_CONSUMERS`), with the replay form for
//! a role that may replay; and that form's handler.

use super::errors::error_page;
use super::forms::{Fields, csrf, hidden};
use super::layout::{page, shown};
use super::overview::submit_selection;
use super::session::WebSession;
use crate::actions::{Action, allowed};
use crate::auth::sessions::Session;
use crate::state::AppState;
use crate::targets::{dead_letters, dead_letters_page};
use crate::text::url_encode;
use axum::Form;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde::Deserialize;

/// The page's query: which consumer, and the page (cursor and the first row's number).
#[derive(Debug, Deserialize)]
pub struct ConsumerQuery {
    consumer: Option<String>,
    after: Option<String>,
    from: Option<String>,
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
            if let Err(e) = crate::text::check_all([("after", q.after.as_deref())]) {
                return error_page(Some(&session), &e);
            }
            let first = match super::paging::first_row(q.from.as_deref()) {
                Ok(f) => f,
                Err(e) => return error_page(Some(&session), &e),
            };
            let found = dead_letters_page::page(
                &s.settings.amqp_url,
                &s.settings.amqp_tls,
                c,
                q.after.as_deref(),
                None,
            )
            .await;
            // A cursor that is none is the caller's fault: the error page (400), not the list.
            if let Err(e @ crate::error::ConsoleError::BadRequest(_)) = &found {
                return error_page(Some(&session), e);
            }
            Some(found.map(|p| (first, p)))
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
            (Some(c), Some(Ok((first, found)))) => (letters_form(&session, c, first, &found)),
            (_, Some(Err(e))) => p.error { (shown(&e.public_message())) },
            _ => {},
        }
    };
    page(Some(&session), "Consumer dead letters", body).into_response()
}

/// A page of the dead letters of `consumer` (its first row numbered `first`), in the replay form
/// when the user's role may replay, with "all that match" besides the ticked rows.
fn letters_form(
    session: &Session,
    consumer: &str,
    first: i64,
    found: &dead_letters_page::LetterPage,
) -> Markup {
    let letters = &found.items;
    let may = allowed(session.principal.role, Action::DlqReplay);
    let base = format!("/dead-letters?consumer={}", url_encode(consumer));
    let footer = super::paging::footer(
        &base,
        first,
        letters.len(),
        found.total as i64,
        found.next.as_deref(),
    );
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
                        @if let Some(id) = &l.message_id {
                            a.dead-letter-link href={ "/dead-letters/" (url_encode(consumer)) "/" (url_encode(id)) } { (shown(id)) }
                        }
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
        return html! { (table) (footer) };
    }
    html! {
        form method="post" action={ "/ui/dead-letters/" (url_encode(consumer)) "/replay" } {
            (hidden(session))
            (table)
            (footer)
            @if found.total > 0 {
                p {
                    label {
                        input type="checkbox" name="all" value="1" id="select-all";
                        " all " (super::paging::thousands(found.total as i64)) " that match, not only the ticked ones (frozen with their versions when you ask)"
                    }
                }
            }
            label { "Reason " input type="text" name="reason" required; }
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
    let path = format!("/api/dead-letters/{}/actions/replay", url_encode(&consumer));
    let action = format!("/ui/dead-letters/{}/replay", url_encode(&consumer));
    submit_selection(&s, &session, &f, (&action, &path), items).await
}
