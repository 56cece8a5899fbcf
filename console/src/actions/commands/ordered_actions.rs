//! Actions on an ordered consumer's stuck aggregate: a retry runs now, a discard asks an approver.

use super::read;
use crate::actions::Action;
use crate::actions::approvals::{self, Pending};
use crate::actions::{self, Caller, Effect, Outcome};
use crate::error::ConsoleError;
use crate::targets::dead_letters;
use crate::targets::ordered::{self, OrderedAction};
use serde_json::json;

/// An action on an ordered consumer's stuck aggregate: a retry runs now; a skip or a dead-lettered
/// run is checked on the position seen and recorded for a second person (a dry run says what it
/// would dead-letter).
pub async fn ordered_action(
    call: &Caller,
    consumer: String,
    action: OrderedAction,
    body: ordered::AggregateAction,
) -> Result<Outcome, ConsoleError> {
    let target = body.target(&consumer);
    call.authorize(Action::Ordered(action), &target, &body.reason)
        .await?;
    let state = &call.state;
    dead_letters::listed(&state.settings.consumers, &consumer)?;
    crate::text::check_all([
        ("aggregate_type", Some(body.aggregate_type.as_str())),
        ("aggregate_id", Some(body.aggregate_id.as_str())),
    ])?;
    if body.dry_run {
        let Some(discard) = action.discard() else {
            return Err(ConsoleError::BadRequest(
                "a retry has no dry run: it discards nothing".into(),
            ));
        };
        let mut tx = state.pool.begin().await?;
        let request = ordered::request(&mut tx, &state.schema, &consumer, discard, &body).await;
        let _ = tx.rollback().await;
        let request = request?;
        return Ok(read(json!({
            "dry_run": true,
            "needs_approval": true,
            "would_dead_letter": request.would_dead_letter,
            "messages": request.messages,
        })));
    }
    let reason = actions::require_reason(&body.reason)?;
    let act = Action::Ordered(action);
    actions::perform(call, act, target, reason, move |mut on| {
        Box::pin(async move {
            let schema = &on.state.schema;
            match action.discard() {
                None => {
                    let (changes, body) = ordered::retry(on.conn, schema, &consumer, &body).await?;
                    Ok(Effect::ok(changes, body))
                }
                Some(discard) => {
                    let request =
                        ordered::request(on.conn, schema, &consumer, discard, &body).await?;
                    let pending = Pending::OrderedDiscard(request);
                    Ok(approvals::create(&mut on, &pending).await?.effect())
                }
            }
        })
    })
    .await
}
