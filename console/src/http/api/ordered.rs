//! `/api/consumers/{consumer}/ordered...`: an ordered consumer's partitions and stuck
//! aggregates, and the actions on them.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::{Action, Caller, commands};
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::{
    dead_letters,
    ordered::{self, OrderedAction},
};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};

/// An ordered consumer: its partitions (owner, epoch, lease) and its stuck aggregates (parked
/// heads; gaps waited on longer than `CONSOLE_ORDERED_GAP_SECONDS`) with their first held
/// messages.
#[utoipa::path(get, path = "/api/consumers/{consumer}/ordered", tag = "ordered-consumers",
    params(("consumer" = String, Path)),
    responses((status = 200, body = ordered::ConsumerView), (status = 404, body = crate::error::ErrorBody)))]
pub async fn ordered_view(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(consumer): Path<String>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, &format!("ordered:{consumer}")).await?;
    dead_letters::listed(&s.settings.consumers, &consumer)?;
    Ok(
        Json(ordered::view(&s.pool, &s.schema, &consumer, s.settings.ordered_gap_after).await?)
            .into_response(),
    )
}

/// An action on a stuck aggregate of an ordered consumer: `retry` runs now; `skip` and
/// `dead_letter_run` discard messages, so they create an approval request (a dry run says what
/// they would dead-letter).
#[utoipa::path(post, path = "/api/consumers/{consumer}/ordered/actions/{action}", tag = "ordered-consumers",
    request_body = ordered::AggregateAction,
    params(("consumer" = String, Path), ("action" = String, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "done"), (status = 202, description = "approval request created"), (status = 403, body = crate::error::ErrorBody),
               (status = 404, description = "no such consumer, action or aggregate", body = crate::error::ErrorBody),
               (status = 409, description = "the aggregate moved on since the version seen, or nothing to do: nothing changed", body = crate::error::ErrorBody)))]
pub async fn ordered_action(
    call: Caller,
    Path((consumer, action)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let action: OrderedAction = action.parse()?;
    let target = format!("ordered:{consumer}");
    let b: ordered::AggregateAction =
        parse_for(&call, Action::Ordered(action), &target, &body).await?;
    Ok(outcome_response(
        commands::ordered_action(&call, consumer, action, b).await?,
    ))
}
