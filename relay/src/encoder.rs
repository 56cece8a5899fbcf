//! The AMQP form of an outbox row, checked before anything is sent.
//!
//! Every way one row could make the broker or lapin fail (a routing key or header name over 255
//! bytes, a reserved header, properties too large for one frame, a payload over the size limit) is
//! found here, as that row's [`EncodeError`]: the pipeline marks the row dead with the reason and
//! goes on. Nothing here can panic on row data, and a refused row never reaches the connection.

use crate::cloudevents::{self, AttributeError};
use crate::store::OutboxRow;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use plumbing::amqp::{HEADER_FRAME_OVERHEAD, headers as h};
use shared::publishable::{self, MessageError};
use std::sync::Arc;

/// How rows are encoded: what bounds their size, and whether they carry CloudEvents attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoding {
    /// The connection's negotiated `frame_max`: properties and headers must fit one frame.
    pub frame_max: u32,
    /// Largest payload sent (RabbitMQ refuses messages over its `max_message_size` by closing the
    /// channel, which would fail every publish in flight).
    pub max_payload_bytes: usize,
    /// CloudEvents binary mode (`RELAY_CLOUDEVENTS=binary`), or `None` for off.
    pub cloudevents: Option<Arc<cloudevents::Binary>>,
}

/// A row ready to hand to lapin.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// The event type, as the routing key.
    pub routing_key: ShortString,
    pub properties: BasicProperties,
}

/// Why a row can never be published as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error(transparent)]
    Rule(#[from] MessageError),
    #[error(
        "its properties and headers take {bytes} bytes, more than one frame holds ({limit} bytes with the broker's frame_max of {frame_max})"
    )]
    FrameTooLarge {
        bytes: usize,
        limit: usize,
        frame_max: u32,
    },
    #[error("its payload has {bytes} bytes, more than the {max} allowed (RELAY_MAX_PAYLOAD_BYTES)")]
    PayloadTooLarge { bytes: usize, max: usize },
    #[error("its properties cannot be encoded: {0}")]
    Encoding(String),
    #[error(transparent)]
    CloudEvents(#[from] AttributeError),
}

/// Encodes `row`: routing key = event type; properties `message_id`, `type`, `content_type`,
/// persistent delivery, `timestamp`; headers = the row's headers plus `aggregate_type`,
/// `aggregate_id`, `aggregate_seq` (signed 64-bit) and `created_at` (RFC 3339, microseconds);
/// in CloudEvents binary mode also the `cloudEvents_*` attributes ([`cloudevents`]).
pub fn encode(row: &OutboxRow, limits: &Encoding) -> Result<Encoded, EncodeError> {
    publishable::check(
        &row.aggregate_type,
        &row.aggregate_id,
        &row.event_type,
        &row.headers,
    )?;
    if row.payload.len() > limits.max_payload_bytes {
        return Err(EncodeError::PayloadTooLarge {
            bytes: row.payload.len(),
            max: limits.max_payload_bytes,
        });
    }
    let short = |s: &str| {
        ShortString::try_new(s)
            .map_err(|_| EncodeError::Rule(MessageError::EventTypeLength(s.len())))
    };
    let routing_key = short(&row.event_type)?;

    let mut headers = FieldTable::default();
    plumbing::amqp::json_to_headers(&row.headers, &mut headers)
        .map_err(|e| EncodeError::Encoding(e.to_string()))?;
    let created = row
        .created_at
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    // Their size goes into the bound below, so the frame check covers them too.
    let mut extra_bytes = 0;
    if let Some(ce) = &limits.cloudevents {
        for (name, value) in ce.attributes(row, &created)? {
            extra_bytes += name.len() + value.len() + 16;
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
        }
    }
    for (name, value) in [
        (h::AGGREGATE_TYPE, row.aggregate_type.as_str()),
        (h::AGGREGATE_ID, row.aggregate_id.as_str()),
        (h::CREATED_AT, created.as_str()),
    ] {
        headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
    }
    headers.insert(
        h::AGGREGATE_SEQ.into(),
        AMQPValue::LongLongInt(row.aggregate_seq),
    );
    headers.insert(
        h::AGGREGATE_PARTITION.into(),
        AMQPValue::LongLongInt(i64::from(row.partition)),
    );
    let properties = BasicProperties::default()
        .with_message_id(ShortString::from(row.id.hyphenated().to_string()))
        .with_type(routing_key.clone())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(u64::try_from(row.created_at.timestamp()).unwrap_or(0))
        .with_headers(headers);

    let limit = (limits.frame_max as usize).saturating_sub(HEADER_FRAME_OVERHEAD);
    // Serializing is exact but costs as much as the publish itself: only near the limit.
    if upper_bound(row) + extra_bytes <= limit {
        return Ok(Encoded {
            routing_key,
            properties,
        });
    }
    let bytes = properties_len(&properties)?;
    if bytes > limit {
        return Err(EncodeError::FrameTooLarge {
            bytes,
            limit,
            frame_max: limits.frame_max,
        });
    }
    Ok(Encoded {
        routing_key,
        properties,
    })
}

/// A bound on the encoded properties of `row` that is never below the exact size: fixed
/// properties and the relay's own headers within 256 bytes, the `type` twice (routing key and
/// property), and each header's name and value with 16 bytes for its length and type fields.
fn upper_bound(row: &OutboxRow) -> usize {
    let headers: usize = row
        .headers
        .iter()
        .map(|(name, value)| {
            let value = match value {
                serde_json::Value::String(s) => s.len(),
                other => other.to_string().len().max(8),
            };
            name.len() + value + 16
        })
        .sum();
    288 + 2 * row.event_type.len() + row.aggregate_type.len() + row.aggregate_id.len() + headers
}

/// The exact size of `properties` on the wire, measured with the protocol's own serializer.
pub fn properties_len(properties: &BasicProperties) -> Result<usize, EncodeError> {
    plumbing::amqp::properties_len(properties)
        .ok_or_else(|| EncodeError::Encoding("the properties cannot be serialized".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{TimeZone, Utc};
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    const LIMITS: Encoding = Encoding {
        frame_max: 131_072,
        max_payload_bytes: 16 * 1024 * 1024,
        cloudevents: None,
    };

    fn row(event_type: &str, aggregate_id: &str, headers: Value) -> OutboxRow {
        OutboxRow {
            seq: 1,
            id: uuid::Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq: 41,
            event_type: event_type.into(),
            payload: "{}".into(),
            headers: headers.as_object().cloned().unwrap_or_default(),
            created_at: Utc.with_ymd_and_hms(2026, 12, 1, 10, 0, 0).unwrap(),
            attempts: 0,
            partition: 0,
        }
    }

    #[test]
    fn encodes_what_consumers_expect() {
        let e = encode(&row("order.placed", "o-1", json!({"tenant": "t"})), &LIMITS).unwrap();
        assert_eq!(e.routing_key.as_str(), "order.placed");
        let p = &e.properties;
        assert_eq!(
            p.message_id().as_ref().unwrap().as_str(),
            "00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "order.placed");
        assert_eq!(p.delivery_mode(), &Some(2));
        let headers = p.headers().as_ref().unwrap();
        assert_eq!(
            plumbing::amqp::header_str(headers, "aggregate_id").as_deref(),
            Some("o-1")
        );
        assert_eq!(
            plumbing::amqp::header_str(headers, "created_at").as_deref(),
            Some("2026-12-01T10:00:00.000000Z")
        );
        assert_eq!(
            plumbing::amqp::header_i64(headers, "aggregate_seq"),
            Some(41)
        );
    }

    #[test]
    fn refuses_what_the_broker_would_choke_on() {
        let err = encode(&row(&"€".repeat(100), "o", json!({})), &LIMITS).unwrap_err();
        assert_eq!(err, EncodeError::Rule(MessageError::EventTypeLength(300)));
        let err = encode(&row("e", "o", json!({"CC": "other-queue"})), &LIMITS).unwrap_err();
        assert!(matches!(
            err,
            EncodeError::Rule(MessageError::HeaderNameReserved { .. })
        ));
        let small = Encoding {
            frame_max: 4096,
            ..LIMITS
        };
        let err = encode(
            &row("e", &"i".repeat(1000), json!({"v": "x".repeat(3500)})),
            &small,
        )
        .unwrap_err();
        assert!(matches!(err, EncodeError::FrameTooLarge { .. }), "{err}");
        let mut big = row("e", "o", json!({}));
        big.payload = "x".repeat(101);
        let tiny = Encoding {
            max_payload_bytes: 100,
            ..LIMITS
        };
        assert!(matches!(
            encode(&big, &tiny),
            Err(EncodeError::PayloadTooLarge { .. })
        ));
    }

    #[test]
    fn the_largest_row_the_door_lets_through_fits_the_default_frame() {
        let mut headers = Map::new();
        // 256 headers sharing 64 KiB of names and values, every name at its 255-byte maximum.
        let value_len = (shared::publishable::MAX_HEADERS_BYTES / 256) - 255;
        for i in 0..256 {
            let name = format!("{i:03}{}", "n".repeat(252));
            headers.insert(name, Value::String("v".repeat(value_len)));
        }
        let r = row(
            &"e".repeat(255),
            &"i".repeat(shared::publishable::MAX_AGGREGATE_ID_BYTES),
            Value::Object(headers),
        );
        let mut r = r;
        r.aggregate_type = "t".repeat(255);
        let e = encode(&r, &LIMITS).expect("fits");
        let len = properties_len(&e.properties).unwrap();
        assert!(len < 131_072 - HEADER_FRAME_OVERHEAD, "{len}");
    }

    fn binary() -> Encoding {
        Encoding {
            cloudevents: Some(Arc::new(
                cloudevents::Binary::new("/outbox", "com.example.").unwrap(),
            )),
            ..LIMITS
        }
    }

    #[test]
    fn binary_mode_adds_attributes_and_leaves_the_rest_alone() {
        let r = row("order.placed", "o-1", json!({"tenant": "t"}));
        let plain = encode(&r, &LIMITS).unwrap();
        let ce = encode(&r, &binary()).unwrap();
        let headers = ce.properties.headers().as_ref().unwrap();
        let get = |n: &str| plumbing::amqp::header_str(headers, n).map(|v| v.into_owned());
        assert_eq!(get("cloudEvents_specversion").as_deref(), Some("1.0"));
        assert_eq!(
            get("cloudEvents_id").as_deref(),
            Some("00000000-0000-0000-0000-000000000000")
        );
        assert_eq!(
            get("cloudEvents_source").as_deref(),
            Some("/outbox/order/o-1")
        );
        assert_eq!(
            get("cloudEvents_type").as_deref(),
            Some("com.example.order.placed")
        );
        assert_eq!(get("cloudEvents_time"), get("created_at"));
        assert_eq!(get("cloudEvents_partitionkey").as_deref(), Some("o-1"));
        assert_eq!(
            get("cloudEvents_sequence").as_deref(),
            Some("00000000000000000041")
        );
        assert_eq!(get("cloudEvents_traceparent"), None);
        // Everything else is what binary mode off sends.
        let mut rest = FieldTable::default();
        let mut attributes = 0;
        for (name, value) in headers.inner() {
            if name.as_str().starts_with("cloudEvents_") {
                attributes += 1;
            } else {
                rest.insert(name.clone(), value.clone());
            }
        }
        assert_eq!(attributes, 7);
        assert_eq!(Some(&rest), plain.properties.headers().as_ref());
        assert_eq!(ce.routing_key, plain.routing_key);
        assert_eq!(
            ce.properties.content_type(),
            plain.properties.content_type()
        );
        assert_eq!(ce.properties.message_id(), plain.properties.message_id());
    }

    #[test]
    fn binary_mode_refuses_an_attribute_over_the_conversion_limit() {
        let r = row("e", "o", json!({"tracestate": "k=v,".repeat(1100)}));
        assert!(encode(&r, &LIMITS).is_ok());
        let err = encode(&r, &binary()).unwrap_err();
        assert!(
            matches!(
                err,
                EncodeError::CloudEvents(AttributeError::TooLong {
                    header: "cloudEvents_tracestate",
                    bytes: 4400,
                })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("4096"), "{err}");
    }

    #[test]
    fn binary_mode_frame_check_counts_the_attributes() {
        // Row headers that nearly fill a small frame: the attributes tip it over.
        let small = Encoding {
            frame_max: 4096,
            ..binary()
        };
        let fits = (0..200)
            .map(|n| {
                let r = row(
                    "e",
                    &"i".repeat(100),
                    json!({"v": "x".repeat(3000 + n * 5)}),
                );
                (
                    encode(
                        &r,
                        &Encoding {
                            frame_max: 4096,
                            ..LIMITS
                        },
                    )
                    .is_ok(),
                    encode(&r, &small),
                )
            })
            .filter(|(plain_ok, _)| *plain_ok)
            .collect::<Vec<_>>();
        assert!(
            fits.iter()
                .any(|(_, ce)| matches!(ce, Err(EncodeError::FrameTooLarge { .. }))),
            "some row fits without the attributes and not with them"
        );
        for (_, ce) in fits {
            if let Ok(e) = ce {
                assert!(properties_len(&e.properties).unwrap() + HEADER_FRAME_OVERHEAD <= 4096);
            }
        }
    }

    fn header_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            any::<String>().prop_map(Value::String),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            any::<bool>().prop_map(Value::Bool),
            Just(Value::Null),
            prop::collection::vec(any::<i32>(), 0..3).prop_map(|v| json!(v)),
        ]
    }

    proptest! {
        /// Whatever a row holds, encoding returns (never panics), and what it returns fits.
        #[test]
        fn any_row_encodes_or_is_refused_never_panics(
            event_type in ".{0,300}",
            aggregate_type in ".{0,300}",
            aggregate_id in ".{0,1100}",
            headers in prop::collection::btree_map(".{0,300}", header_value(), 0..8),
            frame_max in 4096u32..200_000,
        ) {
            let mut r = row(&event_type, &aggregate_id, json!({}));
            r.aggregate_type = aggregate_type;
            r.headers = headers.into_iter().collect();
            let limits = Encoding { frame_max, ..LIMITS };
            if let Ok(e) = encode(&r, &limits) {
                let exact = properties_len(&e.properties).unwrap();
                prop_assert!(exact <= upper_bound(&r), "{} > {}", exact, upper_bound(&r));
                prop_assert!(exact + HEADER_FRAME_OVERHEAD <= frame_max as usize);
                prop_assert!(e.routing_key.as_str().len() <= 255);
            }
        }

        /// In binary mode too: a row encodes with every CloudEvents header a string within the
        /// conversion limit and the required attributes present, or is refused; never a panic.
        #[test]
        fn any_row_encodes_as_a_cloudevent_or_is_refused(
            event_type in ".{0,300}",
            aggregate_type in ".{0,300}",
            aggregate_id in ".{0,1100}",
            aggregate_seq in any::<i64>(),
            traceparent in prop::option::of(".{0,5000}"),
            headers in prop::collection::btree_map(".{0,300}", header_value(), 0..8),
            prefix in "[a-z.]{0,40}",
            frame_max in 4096u32..200_000,
        ) {
            let mut r = row(&event_type, &aggregate_id, json!({}));
            r.aggregate_type = aggregate_type;
            r.aggregate_seq = aggregate_seq;
            r.headers = headers.into_iter().collect();
            if let Some(tp) = traceparent {
                r.headers.insert("traceparent".into(), Value::String(tp));
            }
            let limits = Encoding {
                frame_max,
                cloudevents: Some(Arc::new(cloudevents::Binary::new("/outbox", &prefix).unwrap())),
                ..LIMITS
            };
            if let Ok(e) = encode(&r, &limits) {
                let exact = properties_len(&e.properties).unwrap();
                prop_assert!(exact + HEADER_FRAME_OVERHEAD <= frame_max as usize);
                let table = e.properties.headers().as_ref().unwrap();
                let mut seen = Vec::new();
                for (name, value) in table.inner() {
                    if let Some(attr) = name.as_str().strip_prefix("cloudEvents_") {
                        let AMQPValue::LongString(s) = value else {
                            return Err(TestCaseError::fail(format!("{name} is not a string")));
                        };
                        prop_assert!(s.as_bytes().len() <= cloudevents::MAX_STRING_BYTES);
                        prop_assert!(attr.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
                        seen.push(attr.to_owned());
                    }
                }
                for required in ["specversion", "id", "source", "type", "time", "sequence"] {
                    prop_assert!(seen.iter().any(|s| s == required), "{} missing", required);
                }
                let seq = plumbing::amqp::header_str(table, "cloudEvents_sequence").unwrap();
                prop_assert_eq!(seq.len(), cloudevents::SEQUENCE_DIGITS);
                prop_assert_eq!(seq.parse::<i64>().ok(), Some(r.aggregate_seq));
            }
        }
    }
}
