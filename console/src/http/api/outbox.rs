//! `/api/outbox/...`: dead outbox rows and the backlog; requeueing them.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::{Action, Caller, commands};
use crate::error::ConsoleError;
use crate::http::dto::{Limit, RequeueMany, RequeueOne};
use crate::state::AppState;
use crate::targets::{outbox_dead, outbox_dead_page};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use uuid::Uuid;

/// Dead outbox rows, oldest first, a keyset page at a time: `{items, total, next}` (`next` is
/// the `after` of the next page, null on the last).
#[utoipa::path(get, path = "/api/outbox/dead", tag = "outbox", params(Limit),
    responses((status = 200, description = "{items: [DeadRow], total, next}"), (status = 400, body = crate::error::ErrorBody),
               (status = 401, body = crate::error::ErrorBody)))]
pub async fn dead_rows(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(q): Query<Limit>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "outbox:dead").await?;
    crate::text::check_all([("after", q.after.as_deref())])?;
    let page = outbox_dead_page::page(&s.pool, &s.schema, q.after.as_deref(), q.limit).await?;
    Ok(Json(page).into_response())
}

/// Pending backlog and dead count.
#[utoipa::path(get, path = "/api/outbox/backlog", tag = "outbox", responses((status = 200, body = outbox_dead::Backlog)))]
pub async fn backlog(
    State(s): State<AppState>,
    Bearer(p): Bearer,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "outbox:backlog").await?;
    Ok(Json(outbox_dead::backlog(&s.pool, &s.schema).await?).into_response())
}

/// Requeue one dead row (operator).
#[utoipa::path(post, path = "/api/outbox/dead/{id}/actions/requeue", tag = "outbox", request_body = RequeueOne,
    params(("id" = Uuid, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "requeued"), (status = 403, body = crate::error::ErrorBody),
               (status = 409, description = "stale version: nothing changed", body = crate::error::ErrorBody)))]
pub async fn requeue_one(
    call: Caller,
    Path(id): Path<Uuid>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let target = format!("outbox:{id}");
    let b: RequeueOne = parse_for(&call, Action::OutboxRequeue, &target, &body).await?;
    let items = vec![outbox_dead::Item {
        id,
        version: b.version,
    }];
    Ok(outcome_response(
        commands::requeue_outbox(&call, items, &b.reason, false).await?,
    ))
}

/// Requeue several dead rows: an explicit list, or `all` (every dead row, frozen with its version
/// now: "select all that match"); more than one creates one approval request (202); `dry_run`
/// says what each would do.
#[utoipa::path(post, path = "/api/outbox/dead/actions/requeue", tag = "outbox", request_body = RequeueMany,
    responses((status = 200, description = "done or dry run"), (status = 202, description = "approval request created")))]
pub async fn requeue_many(call: Caller, body: Bytes) -> Result<Response, ConsoleError> {
    let b: RequeueMany = parse_for(&call, Action::OutboxRequeue, "outbox:", &body).await?;
    let items = if b.all {
        // The role check first: a refused caller is audited before anything is read.
        call.authorize(Action::OutboxRequeue, "outbox:all", &b.reason)
            .await?;
        if !b.items.is_empty() {
            return Err(ConsoleError::BadRequest(
                "either `items` or `all`, not both".into(),
            ));
        }
        outbox_dead_page::all(&call.state.pool, &call.state.schema).await?
    } else {
        b.items
    };
    Ok(outcome_response(
        commands::requeue_outbox(&call, items, &b.reason, b.dry_run).await?,
    ))
}
