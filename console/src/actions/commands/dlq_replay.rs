//! Replaying consumer dead letters: one runs now, more than one asks an approver.

use super::{read, targets};
use crate::actions::Action;
use crate::actions::approvals::{self, Pending};
use crate::actions::{self, Effect, Outcome, Request};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::dead_letters;
use serde_json::json;

/// Replay consumer dead letters (same shape as [`super::outbox_requeue::requeue_outbox`]).
pub async fn replay_dead_letters(
    state: &AppState,
    principal: &Principal,
    consumer: String,
    items: Vec<dead_letters::Item>,
    reason: &str,
    dry_run: bool,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let target = targets(&format!("dlq:{consumer}/"), &items, |i| {
        i.message_id.clone()
    });
    actions::authorize(state, principal, Action::DlqReplay, &target, reason).await?;
    dead_letters::listed(&state.settings.consumers, &consumer)?;
    crate::text::check_all(items.iter().flat_map(|i| {
        [
            ("message_id", Some(i.message_id.as_str())),
            ("version", Some(i.version.as_str())),
        ]
    }))?;
    if dry_run {
        let plan = dead_letters::plan(
            &state.settings.amqp_url,
            &state.settings.amqp_tls,
            &consumer,
            &items,
        )
        .await?;
        return Ok(read(
            json!({"dry_run": true, "needs_approval": items.len() > 1, "items": plan}),
        ));
    }
    let reason = actions::require_reason(reason)?;
    let req = Request {
        principal,
        action: Action::DlqReplay,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |mut on| {
        Box::pin(async move {
            let settings = &on.state.settings;
            if items.len() == 1 {
                let (changes, body) =
                    dead_letters::replay(&settings.amqp_url, &settings.amqp_tls, &consumer, &items)
                        .await?;
                Ok(Effect::ok(changes, body))
            } else {
                dead_letters::check(&settings.amqp_url, &settings.amqp_tls, &consumer, &items)
                    .await?;
                let pending = Pending::DlqReplay { consumer, items };
                Ok(approvals::create(&mut on, &pending).await?.effect())
            }
        })
    })
    .await
}
