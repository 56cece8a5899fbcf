//! What a delivery must be before the consumer looks at its content: text that was UTF-8 on the
//! wire, header tables that parsed, nested at most [`MAX_HEADER_DEPTH`] levels and at most
//! [`MAX_HEADER_BYTES`] large. A delivery that is not is dead-lettered as `undecodable` with the
//! [`Refusal`]'s reason, and counted in `consumer_deliveries_rejected_total{reason}`.
//!
//! The parser below lapin (the vendored, patched `amq-protocol-types`, see
//! `vendor/amq-protocol-types/PATCHED.md`) never fails a frame for these: it decodes short strings
//! that are not UTF-8 lossily (U+FFFD), and puts a marker table ([`UNPARSED_KEY`]) in place of a
//! table that is malformed or nested deeper than its own bound. This module turns what the parser
//! let through into a refusal. The walk is iterative: no input can make it recurse.

use lapin::BasicProperties;
use lapin::types::parsing::{MAX_NESTING, UNPARSED_KEY};
use lapin::types::{AMQPValue, FieldTable};

/// Deepest nesting of tables and arrays accepted in headers (the header table itself is level 1).
/// Below the parser's own bound, so a table the parser skipped as too deep is always refused here.
pub const MAX_HEADER_DEPTH: usize = 16;
const _: () = assert!(MAX_HEADER_DEPTH < MAX_NESTING);

/// Largest header table accepted, in bytes on the wire: what the outbox accepts
/// ([`shared::publishable::MAX_HEADERS_BYTES`]) plus 32 KiB of room for what the relay and the
/// consumer add: the relay's own headers (under 1.5 KiB at their column limits), its CloudEvents
/// attributes (under 18 KiB: source, type and the trace context within the encoder's 4,096 bytes
/// each, the partition key within 1,024, the rest fixed in size; see `relay::cloudevents`) and
/// the consumer's retry headers. Test: `the_largest_row_the_relay_publishes_as_a_cloudevent_passes`.
pub const MAX_HEADER_BYTES: usize = shared::publishable::MAX_HEADERS_BYTES + 32 * 1024;

/// The character lossy decoding puts in place of bytes that were not UTF-8.
const REPLACEMENT: char = char::REPLACEMENT_CHARACTER;

/// Why a delivery is refused before decoding (the `reason` label of
/// `consumer_deliveries_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// `message_id`, `type`, the routing key or a header name was not UTF-8.
    NotUtf8,
    /// A header table or array could not be parsed (unknown field type, bad length).
    MalformedHeaders,
    /// Headers nested deeper than [`MAX_HEADER_DEPTH`].
    TooDeep,
    /// Headers larger than [`MAX_HEADER_BYTES`].
    HeadersTooLarge,
    /// Not refused by screening: its retry or dead-letter copy could not be made to fit one frame,
    /// so it was rejected without requeue instead (see [`crate::copies`]).
    CopyTooLarge,
}

impl Reason {
    pub const ALL: [Reason; 5] = [
        Self::NotUtf8,
        Self::MalformedHeaders,
        Self::TooDeep,
        Self::HeadersTooLarge,
        Self::CopyTooLarge,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotUtf8 => "not_utf8",
            Self::MalformedHeaders => "malformed_headers",
            Self::TooDeep => "too_deep",
            Self::HeadersTooLarge => "headers_too_large",
            Self::CopyTooLarge => "copy_too_large",
        }
    }
}

/// A refused delivery: the metric label and the dead-letter reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    pub text: String,
}

impl Refusal {
    fn new(reason: Reason, text: impl Into<String>) -> Self {
        Self {
            reason,
            text: text.into(),
        }
    }
}

/// Checks the properties and routing key of a delivery against the rules above.
pub fn screen(properties: &BasicProperties, routing_key: &str) -> Result<(), Refusal> {
    let fields = [
        (
            "message_id",
            properties.message_id().as_ref().map(|s| s.as_str()),
        ),
        ("type", properties.kind().as_ref().map(|s| s.as_str())),
        ("routing key", Some(routing_key)),
    ];
    for (what, value) in fields {
        if let Some(v) = value
            && v.contains(REPLACEMENT)
        {
            return Err(Refusal::new(
                Reason::NotUtf8,
                format!("{what} is not valid UTF-8 (read as {v:?})"),
            ));
        }
    }
    match properties.headers() {
        Some(table) => screen_headers(table),
        None => Ok(()),
    }
}

/// Checks a header table: names UTF-8, every table parsed, depth and size within bounds.
pub fn screen_headers(table: &FieldTable) -> Result<(), Refusal> {
    let shape = measure(table);
    if let Some(name) = shape.bad_name {
        return Err(Refusal::new(
            Reason::NotUtf8,
            format!("a header name is not valid UTF-8 (read as {name:?})"),
        ));
    }
    if shape.unparsed {
        return Err(Refusal::new(
            Reason::MalformedHeaders,
            "its headers could not be parsed (a malformed or absurdly nested table)",
        ));
    }
    if shape.depth > MAX_HEADER_DEPTH {
        return Err(Refusal::new(
            Reason::TooDeep,
            format!("its headers nest more than {MAX_HEADER_DEPTH} levels deep"),
        ));
    }
    if shape.bytes > MAX_HEADER_BYTES {
        return Err(Refusal::new(
            Reason::HeadersTooLarge,
            format!(
                "its headers take {} bytes, more than the {MAX_HEADER_BYTES} accepted",
                shape.bytes
            ),
        ));
    }
    Ok(())
}

/// What [`measure`] finds in a header table.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Shape {
    /// Nesting levels (a table without tables or arrays in it is 1).
    pub depth: usize,
    /// Size on the wire, length prefix included.
    pub bytes: usize,
    /// A table the parser could not parse (its marker) somewhere inside.
    pub unparsed: bool,
    /// The first name found that was not UTF-8 on the wire.
    pub bad_name: Option<String>,
}

/// Walks a table without recursion.
pub fn measure(table: &FieldTable) -> Shape {
    let mut shape = Shape::default();
    enum Node<'a> {
        Table(&'a FieldTable),
        Value(&'a AMQPValue),
    }
    let mut stack: Vec<(Node<'_>, usize)> = vec![(Node::Table(table), 1)];
    while let Some((node, level)) = stack.pop() {
        match node {
            Node::Table(t) => {
                shape.depth = shape.depth.max(level);
                shape.bytes += 4;
                for (name, value) in t.inner() {
                    let name = name.as_str();
                    if name == UNPARSED_KEY {
                        shape.unparsed = true;
                    }
                    if shape.bad_name.is_none() && name.contains(REPLACEMENT) {
                        shape.bad_name = Some(name.to_string());
                    }
                    shape.bytes += 1 + name.len();
                    stack.push((Node::Value(value), level));
                }
            }
            Node::Value(value) => {
                // The type byte, then the value.
                shape.bytes += 1;
                match value {
                    AMQPValue::FieldTable(t) => stack.push((Node::Table(t), level + 1)),
                    AMQPValue::FieldArray(a) => {
                        shape.depth = shape.depth.max(level + 1);
                        shape.bytes += 4;
                        for v in a.as_slice() {
                            stack.push((Node::Value(v), level + 1));
                        }
                    }
                    other => shape.bytes += scalar_len(other),
                }
            }
        }
    }
    shape
}

/// Wire size of a value that is not a table or array (without its type byte).
fn scalar_len(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.as_bytes().len(),
        AMQPValue::ByteArray(b) => 4 + b.as_slice().len(),
        AMQPValue::Void | AMQPValue::FieldTable(_) | AMQPValue::FieldArray(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString, ShortString};

    fn nested(levels: usize) -> FieldTable {
        let mut t = FieldTable::default();
        for _ in 1..levels {
            let mut outer = FieldTable::default();
            outer.insert("k".into(), AMQPValue::FieldTable(t));
            t = outer;
        }
        t
    }

    /// A `payment.captured` as the relay publishes it, with `headers`.
    fn published(headers: FieldTable) -> BasicProperties {
        BasicProperties::default()
            .with_message_id("0192d3a4-0000-7000-8000-000000000001".into())
            .with_type("payment.captured".into())
            .with_headers(headers)
    }

    #[test]
    fn what_the_relay_publishes_passes() {
        let mut t = FieldTable::default();
        t.insert(
            "traceparent".into(),
            AMQPValue::LongString("00-a-b-01".into()),
        );
        t.insert("x-attempt".into(), AMQPValue::LongLongInt(2));
        assert_eq!(screen(&published(t), "payment.captured"), Ok(()));
    }

    /// The largest headers the relay can publish still pass, so the screen leaves room for what the
    /// relay adds: a row's headers at the outbox's own limit (their trace context included), the
    /// relay's own headers at their column limits, and the CloudEvents attributes at their largest
    /// (source, type and the trace context at the encoder's 4,096-byte bound, the partition key at
    /// the aggregate id's 1,024 bytes, the rest fixed in size).
    #[test]
    fn the_largest_row_the_relay_publishes_as_a_cloudevent_passes() {
        let mut t = FieldTable::default();
        // The row's own headers: 64 KiB of names and values, trace context included.
        let each = shared::publishable::MAX_HEADERS_BYTES / 16 - 16;
        for i in 0..14 {
            t.insert(
                format!("row-{i:03}").into(),
                AMQPValue::LongString("v".repeat(each).into()),
            );
        }
        for name in ["traceparent", "tracestate"] {
            t.insert(name.into(), AMQPValue::LongString("t".repeat(each).into()));
        }
        t.insert(
            "aggregate_type".into(),
            AMQPValue::LongString("a".repeat(255).into()),
        );
        t.insert(
            "aggregate_id".into(),
            AMQPValue::LongString("a".repeat(1024).into()),
        );
        t.insert(
            "created_at".into(),
            AMQPValue::LongString("2026-12-03T08:00:00.000000Z".into()),
        );
        t.insert("aggregate_seq".into(), AMQPValue::LongLongInt(i64::MAX));
        t.insert("aggregate_partition".into(), AMQPValue::ShortShortInt(63));
        let ce = |n: usize| AMQPValue::LongString("c".repeat(n).into());
        for (name, len) in [
            ("specversion", 3),
            ("id", 36),
            ("source", 4096),
            ("type", 4096),
            ("time", 32),
            ("partitionkey", 1024),
            ("sequence", 20),
            ("traceparent", 4096),
            ("tracestate", 4096),
        ] {
            t.insert(format!("cloudEvents_{name}").into(), ce(len));
        }
        // The consumer's own, on a retried copy.
        t.insert("x-attempt".into(), AMQPValue::LongLongInt(9));
        t.insert(
            "x-first-failed-at".into(),
            AMQPValue::LongString("2026-12-03T08:00:00Z".into()),
        );
        assert_eq!(screen(&published(t), "payment.captured"), Ok(()));
    }

    #[test]
    fn lossy_text_depth_markers_and_size_are_refused() {
        let p = BasicProperties::default().with_message_id("a\u{fffd}".into());
        assert_eq!(screen(&p, "k").unwrap_err().reason, Reason::NotUtf8);
        let p = BasicProperties::default().with_type("t\u{fffd}".into());
        assert_eq!(screen(&p, "k").unwrap_err().reason, Reason::NotUtf8);

        let mut t = FieldTable::default();
        t.insert(ShortString::from("n\u{fffd}"), AMQPValue::Boolean(true));
        assert_eq!(screen_headers(&t).unwrap_err().reason, Reason::NotUtf8);

        assert_eq!(screen_headers(&nested(MAX_HEADER_DEPTH)), Ok(()));
        assert_eq!(
            screen_headers(&nested(MAX_HEADER_DEPTH + 1))
                .unwrap_err()
                .reason,
            Reason::TooDeep
        );
        let mut arrays = AMQPValue::Boolean(true);
        for _ in 0..MAX_HEADER_DEPTH {
            arrays = AMQPValue::FieldArray(FieldArray::from(vec![arrays]));
        }
        let mut t = FieldTable::default();
        t.insert("a".into(), arrays);
        assert_eq!(screen_headers(&t).unwrap_err().reason, Reason::TooDeep);

        let mut t = FieldTable::default();
        t.insert(UNPARSED_KEY.into(), AMQPValue::LongString("x".into()));
        assert_eq!(
            screen_headers(&t).unwrap_err().reason,
            Reason::MalformedHeaders
        );

        let mut t = FieldTable::default();
        t.insert(
            "big".into(),
            AMQPValue::LongString(LongString::from(vec![b'x'; MAX_HEADER_BYTES])),
        );
        assert_eq!(
            screen_headers(&t).unwrap_err().reason,
            Reason::HeadersTooLarge
        );
    }

    #[test]
    fn measured_size_is_the_wire_size() {
        let mut inner = FieldTable::default();
        inner.insert("i".into(), AMQPValue::ShortInt(3));
        let mut t = FieldTable::default();
        t.insert("s".into(), AMQPValue::LongString("hello".into()));
        t.insert("t".into(), AMQPValue::FieldTable(inner));
        t.insert(
            "a".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Double(1.0)])),
        );
        let wire =
            cookie_factory::gen_simple(lapin::types::generation::gen_field_table(&t), Vec::new())
                .unwrap();
        assert_eq!(measure(&t).bytes, wire.len());
        assert_eq!(measure(&t).depth, 2);
    }
}
