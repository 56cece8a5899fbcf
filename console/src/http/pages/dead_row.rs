//! One dead outbox row as an item (issue 40, item 4): every field, each header, the payload pretty
//! and as stored, what operators did to it (its requeues and the approval requests that named
//! it), and the requeue form under the same rules as the list. Copy buttons are not there: the
//! console serves no script; the values are plain text to select.

use super::errors::error_page;
use super::forms::hidden;
use super::item;
use super::layout::{page, shown};
use super::session::WebSession;
use crate::actions::{Action, allowed, audit};
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::outbox_dead;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use maud::html;
use uuid::Uuid;

/// `GET /outbox/dead/{id}`.
pub async fn dead_row_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(id): Path<Uuid>,
) -> Response {
    let found = async {
        let row = outbox_dead::one(&s.pool, &s.schema, id).await?;
        let history = audit::of_outbox_row(&s.pool, &s.schema, id).await?;
        Ok::<_, ConsoleError>((row, history))
    };
    let (row, history) = match found.await {
        Ok(f) => f,
        Err(e) => return error_page(Some(&session), &e),
    };
    let Some(r) = row else {
        return error_page(
            Some(&session),
            &ConsoleError::NotFound(format!(
                "dead row {id} (it may have been requeued and published since)"
            )),
        );
    };
    let may_requeue = allowed(session.principal.role, Action::OutboxRequeue);
    let body = html! {
        table #dead-row {
            tr { th { "id" } td { code { (r.id) } } }
            tr { th { "position (seq)" } td { (r.seq) } }
            tr { th { "event type" } td { code { (shown(&r.event_type)) } } }
            tr {
                th { "aggregate" }
                td {
                    (shown(&r.aggregate_type)) "/"
                    a.aggregate href=(super::links::Links::messages(&r.aggregate_id)) { (shown(&r.aggregate_id)) }
                }
            }
            tr { th { "attempts" } td { (r.attempts) } }
            tr { th { "last error" } td #last-error { (shown(r.last_error.as_deref().unwrap_or(""))) } }
            tr { th { "last attempt" } td { (r.last_attempt_at.map(|t| t.to_rfc3339()).unwrap_or_default()) } }
            tr { th { "created" } td { (r.created_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "not a finite time".into())) } }
            tr { th { "version" } td #row-version { (r.version) } }
            @if let Some(u) = &r.unpublishable {
                tr { th { "stays dead" } td { "it breaks a publishability rule: " (shown(u)) "; fix the row first" } }
            }
        }
        h2 { "Headers" }
        (item::headers_table("dead-row-headers", &r.headers))
        h2 { "Payload" }
        (item::body("payload", "as stored", &r.payload))
        @if may_requeue && r.unpublishable.is_none() {
            h2 { "Requeue" }
            form method="post" action="/ui/outbox/requeue" id="dead-row-requeue" {
                (hidden(&session))
                input type="hidden" name="item" value={ (r.id) ":" (r.version) };
                label { "Reason " input type="text" name="reason" id="dead-row-reason" required; }
                " " button name="dry_run" value="1" { "Dry run" }
                " " button name="go" value="1" id="dead-row-submit" { "Requeue this row" }
            }
        }
        (item::history("dead-row-history", &history))
        p { a href="/" { "Overview" } }
    };
    page(Some(&session), "Dead row", body).into_response()
}
