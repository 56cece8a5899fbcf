//! Consumer dead letters, through `consumer::dlq` (browse without removing; replay with the
//! original message id so deduplication keeps the effect single).
//!
//! A dead letter's version is its `x-dead-lettered-at` header (empty when RabbitMQ dead-lettered
//! it without our headers): a message that was replayed and died again has a new one. The effect
//! happens in RabbitMQ, outside the database transaction: the console checks the versions, replays,
//! and commits the audit entry right after the broker confirmed; an interrupted replay is safe to
//! repeat (the consumer deduplicates by message id).

use crate::error::ConsoleError;
use crate::redact;
use crate::targets::Change;
use consumer::dlq::{self, Selection};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;

/// A dead letter as shown (payload and headers redacted).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Letter {
    pub message_id: Option<String>,
    pub event_type: String,
    pub kind: String,
    pub reason: String,
    pub attempts: Option<i64>,
    pub dead_lettered_at: Option<String>,
    /// The version to send with a replay.
    pub version: String,
    pub payload: Value,
    pub headers: Value,
}

/// One message of a replay, with the version seen.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Item {
    pub message_id: String,
    pub version: String,
}

/// Refuses consumer names that are not plain names, by the consumer crate's own rule
/// ([`consumer::config::validate_name`]), so the console accepts exactly the names a consumer can
/// have.
pub fn check_consumer(name: &str) -> Result<(), ConsoleError> {
    consumer::config::validate_name(name).map_err(|_| {
        ConsoleError::BadRequest(format!(
            "consumer must be 1 to {} letters, digits, '.', '_' or '-'",
            consumer::config::MAX_NAME_LEN
        ))
    })
}

/// `CONSOLE_CONSUMERS` is an allowlist: only the dead letters of a consumer listed there can be
/// browsed or replayed; any other name, well-formed or not, is a 404 (checked after the role
/// check, so a refused caller is audited first). A name that is no plain name is a 400.
pub fn listed(consumers: &[String], name: &str) -> Result<(), ConsoleError> {
    crate::text::check("consumer", name)?;
    check_consumer(name)?;
    if consumers.iter().any(|c| c == name) {
        Ok(())
    } else {
        Err(ConsoleError::NotFound(format!(
            "consumer {name:?} (the console shows the consumers of CONSOLE_CONSUMERS)"
        )))
    }
}

pub(super) fn letter(d: dlq::DeadLetter) -> Letter {
    let payload = serde_json::from_str::<Value>(&d.payload).unwrap_or(Value::String(d.payload));
    Letter {
        message_id: d.message_id.as_deref().map(redact::text),
        event_type: redact::text(&d.event_type),
        kind: redact::text(&d.kind),
        reason: redact::text(&d.reason),
        attempts: d.attempts,
        version: d.dead_lettered_at.clone().unwrap_or_default(),
        dead_lettered_at: d.dead_lettered_at,
        payload: redact::value(&payload),
        headers: redact::value(&Value::Object(d.headers)),
    }
}

/// Up to `limit` dead letters of `consumer`, oldest first, left in place.
pub async fn list(
    amqp_url: &str,
    tls: &plumbing::amqp_tls::AmqpTls,
    consumer: &str,
    limit: usize,
) -> Result<Vec<Letter>, ConsoleError> {
    check_consumer(consumer)?;
    Ok(dlq::list(amqp_url, tls, consumer, limit)
        .await?
        .into_iter()
        .map(letter)
        .collect())
}

/// Dead letter `message_id` of `consumer` as shown (redacted), if it is in the dead-letter queue
/// (it is browsed to find it, as a replay's check does).
pub async fn one(
    amqp_url: &str,
    tls: &plumbing::amqp_tls::AmqpTls,
    consumer: &str,
    message_id: &str,
) -> Result<Option<Letter>, ConsoleError> {
    check_consumer(consumer)?;
    Ok(dlq::list(amqp_url, tls, consumer, 100_000)
        .await?
        .into_iter()
        .find(|d| {
            d.message_id
                .as_deref()
                .is_some_and(|m| m.eq_ignore_ascii_case(message_id))
        })
        .map(letter))
}

/// What a replay would do to each item.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Planned {
    pub message_id: String,
    /// `replay`, `stale`, `not_found`.
    pub would: String,
}

async fn judge(
    amqp_url: &str,
    tls: &plumbing::amqp_tls::AmqpTls,
    consumer: &str,
    items: &[Item],
) -> Result<Vec<Planned>, ConsoleError> {
    let raw = dlq::list(amqp_url, tls, consumer, 100_000).await?;
    Ok(items
        .iter()
        .map(|i| {
            let found = raw.iter().find(|d| {
                d.message_id
                    .as_deref()
                    .is_some_and(|m| m.eq_ignore_ascii_case(&i.message_id))
            });
            let would = match found {
                None => "not_found",
                Some(d) if d.dead_lettered_at.clone().unwrap_or_default() != i.version => "stale",
                Some(_) => "replay",
            };
            Planned {
                message_id: redact::text(&i.message_id),
                would: would.into(),
            }
        })
        .collect())
}

/// The dry run (an ordered consumer's dead letters are never replayed: a 409 says why).
pub async fn plan(
    amqp_url: &str,
    tls: &plumbing::amqp_tls::AmqpTls,
    consumer: &str,
    items: &[Item],
) -> Result<Vec<Planned>, ConsoleError> {
    check_consumer(consumer)?;
    dlq::refuse_ordered(amqp_url, tls, consumer).await?;
    judge(amqp_url, tls, consumer, items).await
}

/// Checks the consumer is not ordered (409) and every item is there in the version seen.
pub async fn check(
    amqp_url: &str,
    tls: &plumbing::amqp_tls::AmqpTls,
    consumer: &str,
    items: &[Item],
) -> Result<(), ConsoleError> {
    check_consumer(consumer)?;
    if items.is_empty() {
        return Err(ConsoleError::BadRequest("no messages given".into()));
    }
    dlq::refuse_ordered(amqp_url, tls, consumer).await?;
    for p in judge(amqp_url, tls, consumer, items).await? {
        match p.would.as_str() {
            "replay" => {}
            "not_found" => {
                return Err(ConsoleError::NotFound(format!(
                    "dead letter {}",
                    p.message_id
                )));
            }
            _ => {
                return Err(ConsoleError::Conflict(format!(
                    "dead letter {} changed since the version seen",
                    p.message_id
                )));
            }
        }
    }
    Ok(())
}

/// The effect: replays `items` into the consumer's queue.
pub async fn replay(
    amqp_url: &str,
    tls: &plumbing::amqp_tls::AmqpTls,
    consumer: &str,
    items: &[Item],
) -> Result<(Vec<Change>, Value), ConsoleError> {
    check(amqp_url, tls, consumer, items).await?;
    let ids = items.iter().map(|i| i.message_id.clone()).collect();
    let report = dlq::replay(amqp_url, tls, consumer, &Selection::Ids(ids)).await?;
    let changes = report
        .replayed
        .iter()
        .map(|id| Change {
            target: format!("dlq:{consumer}/{id}"),
            before: Some(json!({"queue": "dead-letter"})),
            after: Some(json!({"queue": consumer, "replayed": true})),
            ..Default::default()
        })
        .collect();
    Ok((
        changes,
        json!({"replayed": report.replayed, "not_found": report.not_found}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_names_follow_the_consumer_crates_rule() {
        // Up to 200 bytes, as a consumer may be named; the console used to stop at 100.
        assert!(check_consumer(&"a".repeat(150)).is_ok());
        assert!(check_consumer(&"a".repeat(consumer::config::MAX_NAME_LEN)).is_ok());
        assert!(check_consumer(&"a".repeat(consumer::config::MAX_NAME_LEN + 1)).is_err());
        assert!(check_consumer("ledger.v2_a-b").is_ok());
        for bad in ["", "a b", "a/b", "ä"] {
            assert!(check_consumer(bad).is_err(), "{bad:?}");
        }
    }
}
