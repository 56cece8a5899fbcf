//! `/api/dead-letters/...`: a consumer's dead letters; replaying them.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::{Action, Caller, commands};
use crate::error::ConsoleError;
use crate::http::dto::{ConsumerQuery, Replay};
use crate::state::AppState;
use crate::targets::{dead_letters, dead_letters_page};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};

/// A consumer's dead letters with their reasons (left in place), a page at a time from the
/// queue's head: `{items, total, next}` (`total` is the queue's depth, `next` the `after` of the
/// next page, null on the last).
#[utoipa::path(get, path = "/api/dead-letters", tag = "dead-letters", params(ConsumerQuery),
    responses((status = 200, description = "{items: [Letter], total, next}"), (status = 400, body = crate::error::ErrorBody),
              (status = 404, body = crate::error::ErrorBody)))]
pub async fn dead_letter_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(q): Query<ConsumerQuery>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, &format!("dlq:{}", q.consumer)).await?;
    dead_letters::listed(&s.settings.consumers, &q.consumer)?;
    crate::text::check_all([("after", q.after.as_deref())])?;
    Ok(Json(
        dead_letters_page::page(
            &s.settings.amqp_url,
            &s.settings.amqp_tls,
            &q.consumer,
            q.after.as_deref(),
            q.limit,
        )
        .await?,
    )
    .into_response())
}

/// Replay dead letters: the ones named in `items`, or `all` (every letter in the queue, frozen
/// with its version now: "select all that match"); one runs now, more than one needs approval. An ordered consumer's dead
/// letters are never replayed: 409, with what to do instead.
#[utoipa::path(post, path = "/api/dead-letters/{consumer}/actions/replay", tag = "dead-letters", request_body = Replay,
    params(("consumer" = String, Path)), responses((status = 200), (status = 202),
        (status = 409, description = "a version changed, or the consumer is ordered", body = crate::error::ErrorBody)))]
pub async fn replay(
    call: Caller,
    Path(consumer): Path<String>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: Replay = parse_for(&call, Action::DlqReplay, &format!("dlq:{consumer}"), &body).await?;
    let items = if b.all {
        // The role check, then the allowlist, before the queue is read.
        let target = format!("dlq:{consumer}/all");
        call.authorize(Action::DlqReplay, &target, &b.reason)
            .await?;
        let s = &call.state;
        dead_letters::listed(&s.settings.consumers, &consumer)?;
        if !b.items.is_empty() {
            return Err(ConsoleError::BadRequest(
                "either `items` or `all`, not both".into(),
            ));
        }
        dead_letters_page::all(&s.settings.amqp_url, &s.settings.amqp_tls, &consumer).await?
    } else {
        b.items
    };
    Ok(outcome_response(
        commands::replay_dead_letters(&call, consumer, items, &b.reason, b.dry_run).await?,
    ))
}
