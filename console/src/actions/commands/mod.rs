//! The console's actions, as the API and the web page both call them: each builds its effect and
//! hands it to [`crate::actions::run::perform`] (role check, idempotency, audit, one transaction).

mod audit_purge;
mod decide;
mod dependency_circuit;
mod dlq_replay;
mod ordered_actions;
mod outbox_requeue;
mod process_actions;
mod process_bulk;

pub use audit_purge::purge_audit;
pub use decide::decide;
pub use dependency_circuit::dependency_circuit;
pub use dlq_replay::replay_dead_letters;
pub use ordered_actions::ordered_action;
pub use outbox_requeue::requeue_outbox;
pub use process_actions::process_action;
pub use process_bulk::process_bulk;

use crate::actions::Outcome;
use axum::http::StatusCode;

/// The longest target that names its items one by one: an approval's target is in a unique
/// index, whose entries PostgreSQL limits to 2,704 bytes (about 70 UUIDs).
const MAX_LISTED_TARGET: usize = 1000;

/// The audit target of several items: `prefix` and their ids, comma-separated; for more than
/// fit, `prefix`, how many and the SHA-256 of the sorted ids (the same set is the same target, so
/// one pending request per set still holds; each item's own audit entry names it).
fn targets<T>(prefix: &str, items: &[T], id: impl Fn(&T) -> String) -> String {
    let mut ids: Vec<String> = items.iter().map(id).collect();
    let listed = format!("{prefix}{}", ids.join(","));
    if listed.len() <= MAX_LISTED_TARGET {
        return listed;
    }
    ids.sort();
    let digest = <sha2::Sha256 as sha2::Digest>::digest(ids.join(",").as_bytes());
    format!(
        "{prefix}{} items, sha256 {}",
        ids.len(),
        hex::encode(digest)
    )
}

/// The answer of a dry run, which changes nothing: 200 with `body`.
fn read(body: serde_json::Value) -> Outcome {
    Outcome {
        status: StatusCode::OK,
        body: body.to_string(),
    }
}
