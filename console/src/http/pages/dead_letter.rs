//! One dead letter as an item (issue 40, item 4): its properties, every header (the broker's
//! `x-death` included), the body pretty and as received, what operators did to it (its replays
//! and the approval requests that named it), and the replay form under the same rules as the list.

use super::errors::error_page;
use super::forms::hidden;
use super::item;
use super::layout::{page, shown};
use super::session::WebSession;
use crate::actions::{Action, allowed, audit};
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::dead_letters;
use crate::text::url_encode;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use maud::html;

/// `GET /dead-letters/{consumer}/{message_id}`.
pub async fn dead_letter_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path((consumer, message_id)): Path<(String, String)>,
) -> Response {
    let found = async {
        dead_letters::listed(&s.settings.consumers, &consumer)?;
        crate::text::check("message id", &message_id)?;
        let letter = dead_letters::one(
            &s.settings.amqp_url,
            &s.settings.amqp_tls,
            &consumer,
            &message_id,
        )
        .await?;
        let history = audit::of_dead_letter(&s.pool, &s.schema, &consumer, &message_id).await?;
        Ok::<_, ConsoleError>((letter, history))
    };
    let (letter, history) = match found.await {
        Ok(f) => f,
        Err(e) => return error_page(Some(&session), &e),
    };
    let Some(l) = letter else {
        return error_page(
            Some(&session),
            &ConsoleError::NotFound(format!(
                "dead letter {message_id} of {consumer} (it may have been replayed since)"
            )),
        );
    };
    let may_replay = allowed(session.principal.role, Action::DlqReplay);
    let id = l.message_id.clone().unwrap_or_default();
    let body = html! {
        table #dead-letter {
            tr { th { "consumer" } td { a href={ "/dead-letters?consumer=" (url_encode(&consumer)) } { (shown(&consumer)) } } }
            tr { th { "message id" } td { code { (shown(&id)) } } }
            tr { th { "event type" } td { code { (shown(&l.event_type)) } } }
            tr { th { "kind" } td { (shown(&l.kind)) } }
            tr { th { "reason" } td #letter-reason { (shown(&l.reason)) } }
            tr { th { "attempts" } td { (l.attempts.map(|a| a.to_string()).unwrap_or_default()) } }
            tr { th { "dead-lettered at" } td { (shown(l.dead_lettered_at.as_deref().unwrap_or(""))) } }
            tr { th { "version" } td #letter-version { (shown(&l.version)) } }
        }
        h2 { "Headers" }
        (item::headers_table("dead-letter-headers", &l.headers))
        h2 { "Body" }
        (item::body("letter", "as received", &l.payload))
        @if may_replay {
            h2 { "Replay" }
            form method="post" action={ "/ui/dead-letters/" (url_encode(&consumer)) "/replay" } id="dead-letter-replay" {
                (hidden(&session))
                input type="hidden" name="item" value={ (shown(&id)) "|" (shown(&l.version)) };
                label { "Reason " input type="text" name="reason" id="dead-letter-reason" required; }
                " " button name="dry_run" value="1" { "Dry run" }
                " " button name="go" value="1" id="dead-letter-submit" { "Replay this message" }
            }
        }
        (item::history("dead-letter-history", &history))
    };
    page(Some(&session), "Dead letter", body).into_response()
}
