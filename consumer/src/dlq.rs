//! Dead letters: list them with their reasons, replay them into the consumer's queue.
//!
//! Listing browses the dead-letter queue (`basic.get` without ack, then closing the channel puts
//! every message back in place). Replaying publishes a copy to the consumer's queue with its
//! original properties, message id included, and acknowledges the dead letter only after the
//! broker confirmed the copy: a replay interrupted in between leaves both, and deduplication
//! applies the effect once anyway.
//!
//! An ordered consumer's dead letters are listed but never replayed ([`DlqError::Ordered`]): it
//! consumes its partition queues, not `NAME`, and deduplicates by position, so a copy of a message
//! its aggregate has moved past could never be applied in order.

use crate::broker_headers;
use crate::error::DlqError;
use crate::message::{self, headers};
use crate::topology::Topology;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use plumbing::amqp::{header_str, headers_to_json};
use plumbing::amqp_tls::AmqpTls;
use serde::Serialize;
use serde_json::{Map, Value};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(30);

/// One message in the dead-letter queue.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    /// AMQP message_id (the outbox id), if the message had one.
    pub message_id: Option<String>,
    /// Event type (type property or original routing key).
    pub event_type: String,
    /// `undecodable`, `unknown_event_type`, `permanent`, `exhausted`, or `broker:<reason>` when
    /// RabbitMQ dead-lettered it (e.g. `broker:delivery_limit`).
    pub kind: String,
    /// Why, in words.
    pub reason: String,
    /// Handler runs made before it was dead-lettered.
    pub attempts: Option<i64>,
    /// When (RFC 3339).
    pub dead_lettered_at: Option<String>,
    /// The body as text (lossy if it is not UTF-8).
    pub payload: String,
    /// All headers, as JSON.
    pub headers: Map<String, Value>,
}

/// Which dead letters to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    All,
    /// By message id (a message without one can only be replayed with [`Selection::All`]).
    Ids(Vec<String>),
}

/// What a replay did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplayReport {
    /// Message ids re-injected into the consumer's queue (in DLQ order).
    pub replayed: Vec<String>,
    /// Requested ids that were not in the dead-letter queue.
    pub not_found: Vec<String>,
}

/// Lists up to `limit` dead letters of consumer `name`, oldest first, leaving them in place.
pub async fn list(
    amqp_url: &str,
    tls: &AmqpTls,
    name: &str,
    limit: usize,
) -> Result<Vec<DeadLetter>, DlqError> {
    let topology = Topology::new(name, &[]);
    let conn =
        plumbing::amqp_nodes::connect(amqp_url, tls, &format!("consumer {name} dlq list")).await?;
    let result = list_on(&conn, name, &topology, limit).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.close(200, "done".into())).await;
    result.map(|(letters, _)| letters)
}

/// A page of the dead letters of consumer `name`: up to `limit` after the first `skip`, oldest
/// first, left in place; and the queue's depth (how many there are in all). A page is read from
/// the head (a queue has no index), so a deep page costs its position: dead-letter queues are
/// meant to stay short.
pub async fn page(
    amqp_url: &str,
    tls: &AmqpTls,
    name: &str,
    skip: usize,
    limit: usize,
) -> Result<(Vec<DeadLetter>, usize), DlqError> {
    let topology = Topology::new(name, &[]);
    let conn =
        plumbing::amqp_nodes::connect(amqp_url, tls, &format!("consumer {name} dlq page")).await?;
    let result = list_on(&conn, name, &topology, skip.saturating_add(limit)).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.close(200, "done".into())).await;
    result.map(|(letters, depth)| (letters.into_iter().skip(skip).collect(), depth))
}

/// How many dead letters consumer `name` holds (the dead-letter queue's depth), without reading
/// any: a passive declare.
pub async fn depth(amqp_url: &str, tls: &AmqpTls, name: &str) -> Result<usize, DlqError> {
    let topology = Topology::new(name, &[]);
    let conn =
        plumbing::amqp_nodes::connect(amqp_url, tls, &format!("consumer {name} dlq depth")).await?;
    let result = dlq_count(&conn, name, &topology).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.close(200, "done".into())).await;
    result
}

/// Up to `limit` dead letters from the head, and the queue's depth.
async fn list_on(
    conn: &Connection,
    name: &str,
    t: &Topology,
    limit: usize,
) -> Result<(Vec<DeadLetter>, usize), DlqError> {
    let ch = conn.create_channel().await?;
    let count = dlq_count(conn, name, t).await?;
    let mut out = Vec::new();
    while out.len() < count.min(limit) {
        let Some(m) = next_letter(&ch, t).await? else {
            break;
        };
        out.push(describe(&m.delivery));
    }
    // Nothing was acknowledged: closing the channel puts every message back.
    let _ = tokio::time::timeout(Duration::from_secs(5), ch.close(200, "browsed".into())).await;
    Ok((out, count))
}

/// Re-injects the selected dead letters of consumer `name` into its queue, with their original
/// message ids, a fresh attempt budget, and the dead-letter and broker-owned headers removed
/// (see [`crate::broker_headers`]); `x-replayed-kind` keeps the kind the letter had.
pub async fn replay(
    amqp_url: &str,
    tls: &AmqpTls,
    name: &str,
    selection: &Selection,
) -> Result<ReplayReport, DlqError> {
    let topology = Topology::new(name, &[]);
    let conn = plumbing::amqp_nodes::connect(amqp_url, tls, &format!("consumer {name} dlq replay"))
        .await?;
    let result = replay_on(&conn, name, &topology, selection).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.close(200, "done".into())).await;
    result
}

/// Refuses consumer `name` if it is an ordered consumer ([`DlqError::Ordered`]): what
/// [`replay`] checks first, for callers that check before they ask for a replay (the console,
/// before an approval is requested).
pub async fn refuse_ordered(amqp_url: &str, tls: &AmqpTls, name: &str) -> Result<(), DlqError> {
    let conn =
        plumbing::amqp_nodes::connect(amqp_url, tls, &format!("consumer {name} dlq check")).await?;
    let result = not_ordered(&conn, name).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.close(200, "done".into())).await;
    result
}

/// An ordered consumer has its headers exchange `NAME.ordered` (declared by every instance at
/// every connection, never deleted by the runtime): a passive declare on a channel of its own
/// (the broker closes it when the exchange is missing) tells.
async fn not_ordered(conn: &Connection, name: &str) -> Result<(), DlqError> {
    let exchange = crate::ordered::topology::exchange(name);
    let ch = conn.create_channel().await?;
    let declared = bounded(
        "looking for the ordered consumer's exchange",
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Headers,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await;
    match declared {
        Ok(()) => {
            let _ =
                tokio::time::timeout(Duration::from_secs(5), ch.close(200, "checked".into())).await;
            Err(DlqError::Ordered {
                consumer: name.to_string(),
                exchange,
            })
        }
        Err(DlqError::Amqp(e)) if not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

fn not_found(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
    )
}

async fn replay_on(
    conn: &Connection,
    name: &str,
    t: &Topology,
    selection: &Selection,
) -> Result<ReplayReport, DlqError> {
    not_ordered(conn, name).await?;
    check_queue(conn, t).await?;

    let ch = conn.create_channel().await?;
    let publisher = conn.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let count = dlq_count(conn, name, t).await?;
    let mut report = ReplayReport::default();
    for _ in 0..count {
        let Some(m) = next_letter(&ch, t).await? else {
            break;
        };
        let d = &m.delivery;
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string());
        let selected = match selection {
            Selection::All => true,
            Selection::Ids(ids) => id
                .as_ref()
                .is_some_and(|i| ids.iter().any(|x| x.eq_ignore_ascii_case(i))),
        };
        if !selected {
            continue;
        }
        let props = replay_properties(d);
        let label = id.clone().unwrap_or_else(|| "(no message id)".to_string());
        republish(&publisher, t, d, props, &label).await?;
        report.replayed.push(label);
    }
    if let Selection::Ids(ids) = selection {
        report.not_found = ids
            .iter()
            .filter(|i| !report.replayed.iter().any(|r| r.eq_ignore_ascii_case(i)))
            .cloned()
            .collect();
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), ch.close(200, "replayed".into())).await;
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        publisher.close(200, "replayed".into()),
    )
    .await;
    Ok(report)
}

/// The replay's queue (the consumer's own) must exist: a replay into nothing would lose the
/// letters.
async fn check_queue(conn: &Connection, t: &Topology) -> Result<(), DlqError> {
    plumbing::amqp::inspect_queue(conn, &t.queue)
        .await
        .map_err(|source| DlqError::NoQueue {
            queue: t.queue.clone(),
            source,
        })?;
    Ok(())
}

/// A dead letter's properties as replayed: persistent, its dead-letter headers and the broker's
/// removed, its attempt back to 1, and what it was and where it went noted.
fn replay_properties(d: &Delivery) -> BasicProperties {
    let mut table = d.properties.headers().clone().unwrap_or_default();
    let original_key = message::original_routing_key(&d.properties, d.routing_key.as_str());
    let kind = describe(d).kind;
    // The broker's `x-death` would make RabbitMQ 3.x drop the replayed message as a
    // dead-letter cycle once a retry queue dead-letters it back (see `broker_headers`).
    broker_headers::strip(&mut table);
    message::remove(
        &mut table,
        &[
            headers::DEAD_LETTER_KIND,
            headers::DEAD_LETTER_REASON,
            headers::DEAD_LETTERED_AT,
            headers::DEAD_LETTER_CONSUMER,
            headers::LAST_ERROR,
        ],
    );
    message::set_int(&mut table, headers::ATTEMPT, 1);
    message::set_text(&mut table, headers::REPLAYED_KIND, &kind);
    message::set_text(&mut table, headers::ORIGINAL_ROUTING_KEY, &original_key);
    message::set_text(
        &mut table,
        headers::REPLAYED_AT,
        &chrono::Utc::now().to_rfc3339(),
    );
    d.properties
        .clone()
        .with_headers(table)
        .with_delivery_mode(2)
}

/// Publishes the replayed message `d` to the consumer's queue and, once the broker confirmed it
/// (routed), acknowledges the dead letter.
async fn republish(
    publisher: &Channel,
    t: &Topology,
    d: &Delivery,
    props: BasicProperties,
    label: &str,
) -> Result<(), DlqError> {
    let confirm = publisher
        .basic_publish(
            "".into(),
            t.queue.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &d.data,
            props,
        )
        .await?;
    let confirmation = bounded("confirming a replayed message", confirm).await?;
    if !confirmation.is_ack() {
        return Err(DlqError::NotConfirmed(label.to_string()));
    }
    if confirmation.take_message().is_some() {
        return Err(DlqError::NotConfirmed(label.to_string()));
    }
    bounded(
        "acknowledging a replayed dead letter",
        d.ack(BasicAckOptions::default()),
    )
    .await?;
    Ok(())
}

/// The next dead letter, unacknowledged (closing `ch` without an ack puts it back); `None` when
/// the queue is empty.
async fn next_letter(
    ch: &Channel,
    t: &Topology,
) -> Result<Option<lapin::message::BasicGetMessage>, DlqError> {
    bounded(
        "reading the dead-letter queue",
        ch.basic_get(
            t.dead_letter_queue.as_str().into(),
            BasicGetOptions { no_ack: false },
        ),
    )
    .await
}

/// The dead-letter queue's depth, by a passive declare on a channel of its own (a missing queue
/// closes that channel, not the caller's).
async fn dlq_count(conn: &Connection, name: &str, t: &Topology) -> Result<usize, DlqError> {
    let q = plumbing::amqp::inspect_queue(conn, &t.dead_letter_queue)
        .await
        .map_err(|source| DlqError::NoDeadLetterQueue {
            queue: t.dead_letter_queue.clone(),
            consumer: name.to_string(),
            source,
        })?;
    Ok(q.message_count() as usize)
}

async fn bounded<T>(
    what: &'static str,
    fut: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, DlqError> {
    match tokio::time::timeout(TIMEOUT, fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(DlqError::Timeout(what, TIMEOUT)),
    }
}

fn describe(d: &lapin::message::Delivery) -> DeadLetter {
    let empty = FieldTable::default();
    let table = d.properties.headers().as_ref().unwrap_or(&empty);
    let (kind, reason) = match header_str(table, headers::DEAD_LETTER_KIND) {
        Some(kind) => (
            kind.into_owned(),
            header_str(table, headers::DEAD_LETTER_REASON)
                .map(|s| s.into_owned())
                .unwrap_or_default(),
        ),
        None => match last_death(table) {
            Some((why, queue)) => (
                format!("broker:{why}"),
                format!("dead-lettered by RabbitMQ ({why}) from queue {queue}"),
            ),
            None => ("unknown".to_string(), String::new()),
        },
    };
    DeadLetter {
        message_id: d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string()),
        event_type: message::event_type(&d.properties, d.routing_key.as_str()),
        kind,
        reason,
        attempts: message::header_int(table, headers::ATTEMPT),
        dead_lettered_at: header_str(table, headers::DEAD_LETTERED_AT).map(|s| s.into_owned()),
        payload: String::from_utf8_lossy(&d.data).into_owned(),
        headers: headers_to_json(table),
    }
}

/// Reason and queue of the most recent broker dead-lettering: the head of `x-death` (RabbitMQ
/// keeps it most recent first).
fn last_death(table: &FieldTable) -> Option<(String, String)> {
    let AMQPValue::FieldArray(deaths) = table.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(last) = deaths.as_slice().first()? else {
        return None;
    };
    let why = header_str(last, "reason")?.into_owned();
    let queue = header_str(last, "queue")
        .map(|s| s.into_owned())
        .unwrap_or_default();
    Some((why, queue))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::BasicProperties;
    use lapin::message::Delivery;
    use lapin::types::FieldArray;

    fn delivery(headers: FieldTable) -> Delivery {
        let mut d = Delivery::mock(
            1,
            "x.dlx".into(),
            "payment.captured".into(),
            false,
            b"{}".to_vec(),
        );
        d.properties = BasicProperties::default()
            .with_message_id("0192d3a4-0000-7000-8000-000000000001".into())
            .with_headers(headers);
        d
    }

    #[test]
    fn our_reason_first_then_the_brokers() {
        let mut t = FieldTable::default();
        message::set_text(&mut t, headers::DEAD_LETTER_KIND, "permanent");
        message::set_text(&mut t, headers::DEAD_LETTER_REASON, "refused");
        message::set_int(&mut t, headers::ATTEMPT, 2);
        let l = describe(&delivery(t));
        assert_eq!(
            (l.kind.as_str(), l.reason.as_str(), l.attempts),
            ("permanent", "refused", Some(2))
        );
        assert_eq!(l.event_type, "payment.captured");

        let death = |reason: &str, queue: &str| {
            let mut d = FieldTable::default();
            message::set_text(&mut d, "reason", reason);
            message::set_text(&mut d, "queue", queue);
            AMQPValue::FieldTable(d)
        };
        let mut deaths = FieldArray::default();
        deaths.push(death("delivery_limit", "ledger"));
        deaths.push(death("expired", "ledger.retry.1s"));
        let mut t = FieldTable::default();
        t.insert("x-death".into(), AMQPValue::FieldArray(deaths));
        let l = describe(&delivery(t));
        assert_eq!(l.kind, "broker:delivery_limit");
        assert!(l.reason.contains("from queue ledger"), "{}", l.reason);

        let l = describe(&delivery(FieldTable::default()));
        assert_eq!(l.kind, "unknown");
    }
}
