//! Replaying consumer dead letters: one runs now, more than one asks an approver.

use super::{read, targets};
use crate::actions::Action;
use crate::actions::approvals::{self, Pending};
use crate::actions::{self, Caller, Effect, Outcome};
use crate::error::ConsoleError;
use crate::targets::dead_letters;
use serde_json::json;

/// Replay consumer dead letters (same shape as [`super::outbox_requeue::requeue_outbox`]).
pub async fn replay_dead_letters(
    call: &Caller,
    consumer: String,
    items: Vec<dead_letters::Item>,
    reason: &str,
    dry_run: bool,
) -> Result<Outcome, ConsoleError> {
    let target = targets(&format!("dlq:{consumer}/"), &items, |i| {
        i.message_id.clone()
    });
    call.authorize(Action::DlqReplay, &target, reason).await?;
    let settings = &call.state.settings;
    dead_letters::listed(&settings.consumers, &consumer)?;
    crate::text::check_all(items.iter().flat_map(|i| {
        [
            ("message_id", Some(i.message_id.as_str())),
            ("version", Some(i.version.as_str())),
        ]
    }))?;
    if dry_run {
        let plan =
            dead_letters::plan(&settings.amqp_url, &settings.amqp_tls, &consumer, &items).await?;
        return Ok(read(
            json!({"dry_run": true, "needs_approval": items.len() > 1, "items": plan}),
        ));
    }
    let reason = actions::require_reason(reason)?;
    actions::perform(call, Action::DlqReplay, target, reason, move |mut on| {
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
