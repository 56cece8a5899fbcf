//! `GET /messages?aggregate_id=...`: the outbox messages of one aggregate (an order's, a
//! payment's), read through the relay crate ([`relay::aggregate::messages_of`]), and the
//! processes whose business key it is ([`processes::look::of_key`]). Where a link from a process,
//! a dead row or a dead letter to "its events" lands; each message links on to the ids its
//! payload names, its trace, and, when dead, the dead rows.

use super::badge::badge;
use super::errors::error_page;
use super::layout::{page, shown};
use super::links::Links;
use super::session::WebSession;
use crate::error::ConsoleError;
use crate::redact;
use crate::state::AppState;
use crate::text;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use relay::aggregate::AggregateMessage;
use relay::row_state::RowState;
use serde::Deserialize;
use serde_json::Value;

/// The page's query.
#[derive(Debug, Deserialize)]
pub struct MessagesQuery {
    aggregate_id: Option<String>,
}

/// Ids a payload may name that are aggregates of their own (`order_id` of a payment).
const RELATED: [&str; 3] = ["order_id", "payment_id", "customer_id"];

/// `GET /messages`.
pub async fn messages_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(q): Query<MessagesQuery>,
) -> Response {
    let id = q.aggregate_id.unwrap_or_default();
    if let Err(e) = check(&id) {
        return error_page(Some(&session), &e);
    }
    let found = async {
        let messages = relay::aggregate::messages_of(&s.pool, &s.schema, &id, 200).await?;
        let processes = processes::look::of_key(&s.pool, &s.schema, &id).await?;
        Ok::<_, ConsoleError>((messages, processes))
    };
    let (messages, processes) = match found.await {
        Ok(f) => f,
        Err(e) => return error_page(Some(&session), &e),
    };
    let links = Links::new(&s.settings.look);
    let body = html! {
        form method="get" id="messages-form" {
            label { "Aggregate id " input type="text" name="aggregate_id" value=(shown(&id)); }
            " " button { "Show" }
        }
        h2 { "Processes of " code { (shown(&id)) } }
        @if processes.is_empty() { p #no-processes { "None has this business key." } }
        ul #key-processes {
            @for p in &processes {
                li {
                    a href={ "/processes/" (p.id) } { (shown(&p.kind)) " " code { (p.id) } } " " (badge(&p.status))
                }
            }
        }
        h2 { "Outbox messages (newest first, at most 200)" }
        @if messages.is_empty() {
            p #no-messages { "No message of this aggregate is kept (published rows may have been deleted or purged)." }
        } @else {
            (table(&messages, &links))
        }
    };
    page(Some(&session), "Outbox messages", body).into_response()
}

/// An aggregate id to look up: 1 to 1024 bytes (the outbox's limit), no control character.
fn check(id: &str) -> Result<(), ConsoleError> {
    text::check("aggregate_id", id)?;
    if id.is_empty() || id.len() > 1024 {
        return Err(ConsoleError::BadRequest(
            "aggregate_id: 1 to 1024 bytes".into(),
        ));
    }
    Ok(())
}

fn table(messages: &[AggregateMessage], links: &Links) -> Markup {
    html! {
        table #messages {
            tr {
                th { "#" } th { "id" } th { "aggregate" } th { "event" } th { "state" } th { "attempts" }
                th { "created" } th { "published" } th { "links" } th { "payload" }
            }
            @for m in messages {
                @let payload = redact::value(&m.payload);
                tr.message id={ "message-" (m.id) } {
                    td { @if let Some(n) = m.aggregate_seq { (n) } }
                    td { code { (m.id) } }
                    td { (shown(&m.aggregate_type)) }
                    td { (shown(&m.event_type)) }
                    td { (badge(m.state.as_str())) (m.last_error.as_deref().map(|e| format!(" {}", shown(e))).unwrap_or_default()) }
                    td { (m.attempts) }
                    td { @if let Some(t) = m.created_at { (t.format("%Y-%m-%d %H:%M:%S")) } }
                    td { @if let Some(t) = m.published_at { (t.format("%Y-%m-%d %H:%M:%S")) } }
                    td { (message_links(m, &payload, links)) }
                    td { code { (shown(&payload.to_string())) } }
                }
            }
        }
    }
}

/// Where a message leads: the aggregates its payload names, its trace, the dead rows.
fn message_links(m: &AggregateMessage, payload: &Value, links: &Links) -> Markup {
    let related: Vec<(&str, String)> = RELATED
        .iter()
        .filter_map(|k| payload[k].as_str().map(|v| (*k, shown(v))))
        .filter(|(_, v)| *v != m.aggregate_id)
        .collect();
    let trace = m.headers["traceparent"]
        .as_str()
        .and_then(|t| links.trace(t));
    html! {
        @for (k, v) in &related {
            a.related href=(Links::messages(v)) { (k.trim_end_matches("_id")) " " code { (v) } } " "
        }
        @if let Some((id, url)) = trace { a.trace href=(url) title=(id) { "trace" } " " }
        @if m.state == RowState::Dead { a.dead href="/#dead-rows" { "dead rows" } }
    }
}
