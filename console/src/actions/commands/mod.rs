//! The console's actions, as the API and the web page both call them: each builds its effect and
//! hands it to [`crate::actions::run::perform`] (role check, idempotency, audit, one transaction).

mod audit_purge;
mod decide;
mod dlq_replay;
mod ordered_actions;
mod outbox_requeue;
mod process_actions;
mod process_bulk;

pub use audit_purge::purge_audit;
pub use decide::decide;
pub use dlq_replay::replay_dead_letters;
pub use ordered_actions::ordered_action;
pub use outbox_requeue::requeue_outbox;
pub use process_actions::process_action;
pub use process_bulk::process_bulk;

use crate::actions::Outcome;
use axum::http::StatusCode;

/// The audit target of several items: `prefix` and their ids, comma-separated.
fn targets<T>(prefix: &str, items: &[T], id: impl Fn(&T) -> String) -> String {
    let ids: Vec<String> = items.iter().map(id).collect();
    format!("{prefix}{}", ids.join(","))
}

/// The answer of a dry run, which changes nothing: 200 with `body`.
fn read(body: serde_json::Value) -> Outcome {
    Outcome {
        status: StatusCode::OK,
        body: body.to_string(),
    }
}
