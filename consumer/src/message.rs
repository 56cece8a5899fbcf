//! From an AMQP delivery to a [`shared::Envelope`], and the headers the consumer adds.

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use plumbing::amqp::{header_i64, header_str, headers as relay_headers, headers_to_json};
use shared::Envelope;
use uuid::Uuid;

/// Header names the consumer sets on retried, dead-lettered and replayed copies.
pub mod headers {
    /// Handler run this delivery is for (1 on the first delivery).
    pub const ATTEMPT: &str = "x-attempt";
    /// Reason of the last transient failure (on retried copies).
    pub const LAST_ERROR: &str = "x-last-error";
    /// Routing key the message was first published with (retry and replay copies travel through
    /// other routes).
    pub const ORIGINAL_ROUTING_KEY: &str = "x-original-routing-key";
    /// Why the message was dead-lettered (human-readable error chain).
    pub const DEAD_LETTER_REASON: &str = "x-dead-letter-reason";
    /// `undecodable`, `unknown_event_type`, `permanent` or `exhausted`.
    pub const DEAD_LETTER_KIND: &str = "x-dead-letter-kind";
    /// When it was dead-lettered (RFC 3339).
    pub const DEAD_LETTERED_AT: &str = "x-dead-lettered-at";
    /// Name of the consumer that dead-lettered it.
    pub const DEAD_LETTER_CONSUMER: &str = "x-dead-letter-consumer";
    /// When `dlq replay` re-injected it (RFC 3339).
    pub const REPLAYED_AT: &str = "x-replayed-at";
    /// The kind the replayed dead letter had (one of [`DEAD_LETTER_KIND`]'s, or `broker:<reason>`
    /// when RabbitMQ dead-lettered it, e.g. `broker:delivery_limit`): the replay drops the
    /// broker's `x-death` (see [`crate::broker_headers`]), this keeps why it was a dead letter.
    pub const REPLAYED_KIND: &str = "x-replayed-kind";
}

/// Why a message went to the dead-letter queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterKind {
    /// No usable message_id, or a body that is not JSON.
    Undecodable,
    /// No handler for the event type, in strict mode.
    UnknownEventType,
    /// The handler returned a permanent error (or panicked).
    Permanent,
    /// Transient failures used up every attempt.
    Exhausted,
}

impl DeadLetterKind {
    pub const ALL: [DeadLetterKind; 4] = [
        Self::Undecodable,
        Self::UnknownEventType,
        Self::Permanent,
        Self::Exhausted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Undecodable => "undecodable",
            Self::UnknownEventType => "unknown_event_type",
            Self::Permanent => "permanent",
            Self::Exhausted => "exhausted",
        }
    }
}

/// Decodes a delivery: [`screen`](crate::screen::screen)s it, then
/// [`decode_screened`]. The error is the dead-letter reason.
pub fn decode(
    properties: &BasicProperties,
    routing_key: &str,
    body: &[u8],
) -> Result<Envelope, String> {
    crate::screen::screen(properties, routing_key).map_err(|r| r.text)?;
    decode_screened(properties, routing_key, body)
}

/// Decodes a delivery that passed [`screen`](crate::screen::screen) (without it, deep headers
/// would be walked recursively).
pub fn decode_screened(
    properties: &BasicProperties,
    routing_key: &str,
    body: &[u8],
) -> Result<Envelope, String> {
    let empty = FieldTable::default();
    let table = properties.headers().as_ref().unwrap_or(&empty);
    let message_id = match properties.message_id() {
        None => return Err("missing message_id property".into()),
        Some(id) => Uuid::parse_str(id.as_str())
            .map_err(|e| format!("message_id {:?} is not a UUID: {e}", id.as_str()))?,
    };
    let event_type = event_type(properties, routing_key);
    if event_type.is_empty() {
        return Err("no event type (type property and routing key are empty)".into());
    }
    let payload: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not valid JSON: {e}"))?;
    let created_at = header_str(table, relay_headers::CREATED_AT)
        .and_then(|s| DateTime::parse_from_rfc3339(&s).ok())
        .map(|t| t.with_timezone(&Utc));
    let aggregate_type = header_str(table, relay_headers::AGGREGATE_TYPE)
        .map(|s| s.into_owned())
        .unwrap_or_default();
    let aggregate_id = header_str(table, relay_headers::AGGREGATE_ID)
        .map(|s| s.into_owned())
        .unwrap_or_default();
    let aggregate_seq = header_i64(table, relay_headers::AGGREGATE_SEQ);
    let mut headers = headers_to_json(table);
    for promoted in [
        relay_headers::AGGREGATE_TYPE,
        relay_headers::AGGREGATE_ID,
        relay_headers::AGGREGATE_SEQ,
        relay_headers::CREATED_AT,
    ] {
        headers.remove(promoted);
    }
    Ok(Envelope {
        message_id,
        event_type,
        aggregate_type,
        aggregate_id,
        aggregate_seq,
        created_at,
        headers,
        payload,
    })
}

/// The event type: the `type` property, else the original routing key (retried copies arrive with
/// the queue name as routing key), else the routing key.
pub fn event_type(properties: &BasicProperties, routing_key: &str) -> String {
    if let Some(t) = properties
        .kind()
        .as_ref()
        .filter(|t| !t.as_str().is_empty())
    {
        return t.as_str().to_string();
    }
    original_routing_key(properties, routing_key)
}

/// Routing key the message was first published with: the header when it is one a routing key can
/// be (at most 255 bytes), else the delivery's routing key.
pub fn original_routing_key(properties: &BasicProperties, routing_key: &str) -> String {
    properties
        .headers()
        .as_ref()
        .and_then(|t| header_str(t, headers::ORIGINAL_ROUTING_KEY).map(|s| s.into_owned()))
        .filter(|k| ShortString::try_new(k.as_str()).is_ok())
        .unwrap_or_else(|| routing_key.to_string())
}

/// The attempt this delivery is for (1 when the header is absent).
pub fn attempt(properties: &BasicProperties) -> u32 {
    properties
        .headers()
        .as_ref()
        .and_then(|t| header_int(t, headers::ATTEMPT))
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n >= 1)
        .unwrap_or(1)
}

/// Reads an integer header of any AMQP integer width (or a decimal string).
pub fn header_int(table: &FieldTable, name: &str) -> Option<i64> {
    match table.inner().get(name)? {
        AMQPValue::ShortShortInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortShortUInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortInt(i) => Some(i64::from(*i)),
        AMQPValue::ShortUInt(i) => Some(i64::from(*i)),
        AMQPValue::LongInt(i) => Some(i64::from(*i)),
        AMQPValue::LongUInt(i) => Some(i64::from(*i)),
        AMQPValue::LongLongInt(i) => Some(*i),
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).trim().parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().trim().parse().ok(),
        _ => None,
    }
}

/// Sets a string header.
pub fn set_text(table: &mut FieldTable, name: &str, value: &str) {
    table.insert(
        ShortString::from(name),
        AMQPValue::LongString(LongString::from(value)),
    );
}

/// Sets an integer header.
pub fn set_int(table: &mut FieldTable, name: &str, value: i64) {
    table.insert(ShortString::from(name), AMQPValue::LongLongInt(value));
}

/// Removes a header (FieldTable has no removal of its own).
pub fn remove(table: &mut FieldTable, names: &[&str]) {
    let mut kept = FieldTable::default();
    for (k, v) in table.inner().iter() {
        if !names.contains(&k.as_str()) {
            kept.insert(k.clone(), v.clone());
        }
    }
    *table = kept;
}

/// Headers carry reasons for humans: keep them short enough for any broker frame.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    format!("{}...", &s[..s.floor_char_boundary(max)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props() -> BasicProperties {
        let mut t = FieldTable::default();
        set_text(&mut t, "aggregate_type", "account");
        set_text(&mut t, "aggregate_id", "a-1");
        set_text(&mut t, "created_at", "2026-11-30T10:00:00.123456Z");
        set_text(&mut t, "traceparent", "00-abc-def-01");
        BasicProperties::default()
            .with_message_id("0192d3a4-0000-7000-8000-000000000001".into())
            .with_type("payment.captured".into())
            .with_headers(t)
    }

    #[test]
    fn decodes_what_the_relay_publishes() {
        let env = decode(
            &props(),
            "payment.captured",
            br#"{"account":"a","amount":5}"#,
        )
        .unwrap();
        assert_eq!(env.event_type, "payment.captured");
        assert_eq!(env.aggregate_type, "account");
        assert_eq!(env.aggregate_id, "a-1");
        assert_eq!(env.created_at.unwrap().timestamp_subsec_micros(), 123_456);
        assert_eq!(env.traceparent(), Some("00-abc-def-01"));
        assert!(!env.headers.contains_key("aggregate_id"));
        assert_eq!(env.payload["amount"], 5);
        assert_eq!(attempt(&props()), 1);
    }

    #[test]
    fn rejects_what_cannot_be_processed() {
        let no_id = BasicProperties::default().with_type("x".into());
        assert!(
            decode(&no_id, "x", b"{}")
                .unwrap_err()
                .contains("missing message_id")
        );
        let bad_id = BasicProperties::default().with_message_id("nope".into());
        assert!(
            decode(&bad_id, "x", b"{}")
                .unwrap_err()
                .contains("not a UUID")
        );
        assert!(
            decode(&props(), "x", b"{not json")
                .unwrap_err()
                .contains("not valid JSON")
        );
    }

    #[test]
    fn retried_copies_keep_their_event_type_and_attempt() {
        let mut t = FieldTable::default();
        set_text(&mut t, headers::ORIGINAL_ROUTING_KEY, "payment.captured");
        set_int(&mut t, headers::ATTEMPT, 3);
        let p = BasicProperties::default().with_headers(t.clone());
        assert_eq!(event_type(&p, "ledger"), "payment.captured");
        assert_eq!(attempt(&p), 3);
        remove(&mut t, &[headers::ATTEMPT]);
        assert!(t.inner().get(headers::ATTEMPT).is_none());
        assert!(t.inner().get(headers::ORIGINAL_ROUTING_KEY).is_some());
        assert_eq!(truncate("héllo", 2), "h...");
    }

    use crate::header_strategies::{cases, nested};
    use proptest::prelude::*;

    /// Short strings as the patched parser can hand them over: any text up to 255 bytes, U+FFFD
    /// (a byte that was not UTF-8) included.
    fn short_text() -> impl Strategy<Value = String> + Clone {
        "[a-z0-9.\u{fffd}\n-]{0,80}|.{0,60}".prop_filter("short string", |s| s.len() <= 255)
    }

    fn value() -> impl Strategy<Value = AMQPValue> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            any::<i8>().prop_map(AMQPValue::ShortShortInt),
            any::<f64>().prop_map(AMQPValue::Double),
            prop::collection::vec(any::<u8>(), 0..64)
                .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
            short_text().prop_map(|s| AMQPValue::ShortString(s.as_str().into())),
            Just(AMQPValue::Void),
        ];
        nested(leaf, short_text(), 48, 3)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        /// Any delivery decodes or is refused with a reason; never a panic. What decodes has a
        /// UUID, an event type that was UTF-8 on the wire, and headers within the bounds.
        #[test]
        fn any_delivery_decodes_or_is_refused(
            id in prop_oneof![short_text(), any::<u128>().prop_map(|n| Uuid::from_u128(n).to_string())],
            kind in short_text(),
            routing_key in short_text(),
            headers in prop::collection::btree_map(short_text(), value(), 0..6),
            body in prop_oneof![prop::collection::vec(any::<u8>(), 0..64), Just(b"{}".to_vec())],
        ) {
            let mut t = FieldTable::default();
            for (k, v) in headers {
                t.insert(k.as_str().into(), v);
            }
            let p = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_type(kind.as_str().into())
                .with_headers(t.clone());
            let _ = attempt(&p);
            let _ = original_routing_key(&p, &routing_key);
            match decode(&p, &routing_key, &body) {
                Ok(env) => {
                    prop_assert_eq!(env.message_id.to_string(), id);
                    prop_assert!(!env.event_type.is_empty());
                    prop_assert!(!env.event_type.contains(char::REPLACEMENT_CHARACTER));
                    prop_assert!(crate::screen::measure(&t).depth <= crate::screen::MAX_HEADER_DEPTH);
                }
                Err(reason) => prop_assert!(!reason.is_empty()),
            }
        }

        /// What the relay publishes comes back as it was: event type, aggregate, headers.
        #[test]
        fn relay_messages_round_trip(
            event_type in "[a-z][a-z0-9._-]{0,60}",
            aggregate_id in ".{0,200}",
            text in prop::collection::btree_map("[b-z][a-z0-9_-]{0,20}", ".{0,100}", 0..6),
            numbers in prop::collection::btree_map("n[a-z0-9_]{0,20}", any::<i64>(), 0..4),
        ) {
            let mut json = serde_json::Map::new();
            for (k, v) in &text {
                json.insert(k.clone(), serde_json::Value::from(v.as_str()));
            }
            for (k, v) in &numbers {
                json.insert(k.clone(), serde_json::Value::from(*v));
            }
            let mut t = FieldTable::default();
            plumbing::amqp::json_to_headers(&json, &mut t).unwrap();
            set_text(&mut t, relay_headers::AGGREGATE_TYPE, "thing");
            set_text(&mut t, relay_headers::AGGREGATE_ID, &aggregate_id);
            let id = Uuid::now_v7();
            let p = BasicProperties::default()
                .with_message_id(id.to_string().as_str().into())
                .with_type(event_type.as_str().into())
                .with_headers(t);
            let env = decode(&p, &event_type, b"{\"a\":1}").unwrap();
            prop_assert_eq!(env.message_id, id);
            prop_assert_eq!(&env.event_type, &event_type);
            prop_assert_eq!(&env.aggregate_id, &aggregate_id);
            prop_assert_eq!(env.headers, json);
        }
    }
}
