//! What an outbox message must satisfy to be publishable to RabbitMQ, checked at the door.
//!
//! The same rules are enforced three times, so that one producer's mistake can never stop the
//! relay: by the outbox table's CHECK constraints (any language, plain SQL), by [`check`] before
//! [`crate::outbox::enqueue`] touches the database (a typed error instead of a constraint
//! violation), and by the relay's encoder for rows that got past the door anyway (such a row goes
//! dead with its reason; it never crashes or stalls the relay).
//!
//! The limits come from AMQP 0-9-1: the routing key, the `type` property and header names are
//! short strings (at most 255 bytes); the properties and headers of a message must fit one frame
//! (RabbitMQ's default `frame_max` is 128 KiB). With every field at its maximum a message's
//! properties stay under 80 KiB.

use serde_json::{Map, Value};

/// Most bytes of an AMQP short string (routing key, `type`, header names).
pub const MAX_SHORT_STRING_BYTES: usize = 255;
/// Most bytes of an `aggregate_id` (sent as a header).
pub const MAX_AGGREGATE_ID_BYTES: usize = 1024;
/// Most entries in `headers`.
pub const MAX_HEADERS: usize = 256;
/// Most bytes of all header names plus all header values (values as text, strings unquoted).
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// Why a message can never be published. Each variant matches a CHECK constraint of the outbox
/// table, named in [`MessageError::constraint`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    #[error(
        "event_type must be 1 to {MAX_SHORT_STRING_BYTES} bytes (it is the AMQP routing key), not {0}"
    )]
    EventTypeLength(usize),
    #[error("aggregate_type must be 1 to {MAX_SHORT_STRING_BYTES} bytes, not {0}")]
    AggregateTypeLength(usize),
    #[error("aggregate_id must be at most {MAX_AGGREGATE_ID_BYTES} bytes, not {0}")]
    AggregateIdLength(usize),
    #[error(
        "header {name:?}: its value must be a string, a number or a boolean (headers are a flat object)"
    )]
    HeaderValueNotScalar { name: String },
    #[error("header {name:?}: the number is out of range for a 64-bit float")]
    HeaderNumberOutOfRange { name: String },
    #[error(
        "header name {name:?} must be 1 to {MAX_SHORT_STRING_BYTES} bytes (an AMQP short string)"
    )]
    HeaderNameLength { name: String },
    #[error(
        "header name {name:?} is reserved: CC and BCC route copies and x-* headers steer RabbitMQ and \
         the consumer runtime, cloudEvents_* and cloudEvents:* are CloudEvents attributes; aggregate_type, \
         aggregate_id, aggregate_seq and created_at are set by the relay"
    )]
    HeaderNameReserved { name: String },
    #[error("at most {MAX_HEADERS} headers, not {0}")]
    TooManyHeaders(usize),
    #[error("headers hold {0} bytes of names and values, more than {MAX_HEADERS_BYTES}")]
    HeadersTooLarge(usize),
}

impl MessageError {
    /// The CHECK constraint of the outbox table that refuses the same thing.
    pub fn constraint(&self) -> &'static str {
        match self {
            Self::EventTypeLength(_) => "messages_event_type_is_amqp_short_string",
            Self::AggregateTypeLength(_) => "messages_aggregate_type_is_amqp_short_string",
            Self::AggregateIdLength(_) => "messages_aggregate_id_at_most_1024_bytes",
            Self::HeaderValueNotScalar { .. } | Self::HeaderNumberOutOfRange { .. } => {
                "messages_headers_flat_object_of_scalars"
            }
            Self::HeaderNameLength { .. } => "messages_header_names_are_amqp_short_strings",
            Self::HeaderNameReserved { .. } => "messages_header_names_not_reserved",
            Self::TooManyHeaders(_) | Self::HeadersTooLarge(_) => {
                "messages_headers_at_most_256_entries_and_64_kib"
            }
        }
    }
}

/// Checks every rule on the fields of a message (what the relay will turn into AMQP).
pub fn check(
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    headers: &Map<String, Value>,
) -> Result<(), MessageError> {
    if event_type.is_empty() || event_type.len() > MAX_SHORT_STRING_BYTES {
        return Err(MessageError::EventTypeLength(event_type.len()));
    }
    if aggregate_type.is_empty() || aggregate_type.len() > MAX_SHORT_STRING_BYTES {
        return Err(MessageError::AggregateTypeLength(aggregate_type.len()));
    }
    if aggregate_id.len() > MAX_AGGREGATE_ID_BYTES {
        return Err(MessageError::AggregateIdLength(aggregate_id.len()));
    }
    check_headers(headers)
}

/// The header rules alone.
pub fn check_headers(headers: &Map<String, Value>) -> Result<(), MessageError> {
    if headers.len() > MAX_HEADERS {
        return Err(MessageError::TooManyHeaders(headers.len()));
    }
    let mut bytes = 0usize;
    for (name, value) in headers {
        check_header_name(name)?;
        bytes += name.len();
        bytes += match value {
            Value::String(s) => s.len(),
            Value::Bool(b) => b.to_string().len(),
            Value::Number(n) => {
                if n.as_f64().is_none_or(|f| !f.is_finite()) {
                    return Err(MessageError::HeaderNumberOutOfRange { name: name.clone() });
                }
                n.to_string().len()
            }
            Value::Null | Value::Array(_) | Value::Object(_) => {
                return Err(MessageError::HeaderValueNotScalar { name: name.clone() });
            }
        };
    }
    if bytes > MAX_HEADERS_BYTES {
        return Err(MessageError::HeadersTooLarge(bytes));
    }
    Ok(())
}

/// A header name: 1 to 255 bytes, and not one RabbitMQ, the consumer runtime or the relay gives a
/// meaning to (compared without regard to case).
pub fn check_header_name(name: &str) -> Result<(), MessageError> {
    if name.is_empty() || name.len() > MAX_SHORT_STRING_BYTES {
        return Err(MessageError::HeaderNameLength {
            name: name.to_string(),
        });
    }
    if is_reserved_header(name) {
        return Err(MessageError::HeaderNameReserved {
            name: name.to_string(),
        });
    }
    Ok(())
}

/// `CC`, `BCC` (sender-selected distribution: copies to other queues), any `x-` name (RabbitMQ's
/// `x-death`, `x-delay`, federation's `x-received-from`, the consumer's `x-attempt`...),
/// `cloudEvents_*` and `cloudEvents:*` (CloudEvents attributes, the relay's to set), and the
/// headers the relay sets itself. Compared without regard to case.
pub fn is_reserved_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower == "cc"
        || lower == "bcc"
        || lower.starts_with("x-")
        || lower.starts_with("cloudevents_")
        || lower.starts_with("cloudevents:")
        || matches!(
            lower.as_str(),
            "aggregate_type"
                | "aggregate_id"
                | "aggregate_seq"
                | "aggregate_partition"
                | "created_at"
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn accepts_ordinary_messages() {
        let h = headers(
            json!({"traceparent": "00-a-b-01", "tenant": "t1", "n": 3, "r": 0.5, "ok": true}),
        );
        assert_eq!(check("order", "o-1", "order.placed", &h), Ok(()));
        assert_eq!(check("order", "", "order.placed", &Map::new()), Ok(()));
    }

    #[test]
    fn byte_lengths_not_characters() {
        let hundred_3_byte_chars = "€".repeat(100);
        assert_eq!(hundred_3_byte_chars.chars().count(), 100);
        assert_eq!(
            check("order", "o", &hundred_3_byte_chars, &Map::new()),
            Err(MessageError::EventTypeLength(300))
        );
        assert!(check(&"a".repeat(256), "o", "e", &Map::new()).is_err());
        assert!(check("a", &"i".repeat(1025), "e", &Map::new()).is_err());
        assert!(check("", "o", "e", &Map::new()).is_err());
        assert!(check("a", "o", "", &Map::new()).is_err());
        let long_name = headers(json!({ "é".repeat(128): "v" }));
        assert!(matches!(
            check_headers(&long_name),
            Err(MessageError::HeaderNameLength { .. })
        ));
    }

    #[test]
    fn reserved_and_nested_headers_are_refused() {
        for name in [
            "CC",
            "bcc",
            "x-death",
            "X-Delay",
            "aggregate_id",
            "Created_At",
        ] {
            let h = headers(json!({ name: "v" }));
            assert!(
                matches!(
                    check_headers(&h),
                    Err(MessageError::HeaderNameReserved { .. })
                ),
                "{name}"
            );
        }
        for v in [json!(null), json!([1]), json!({"a": 1})] {
            let h = headers(json!({ "k": v }));
            assert!(matches!(
                check_headers(&h),
                Err(MessageError::HeaderValueNotScalar { .. })
            ));
        }
    }

    #[test]
    fn size_limits() {
        let mut h = Map::new();
        for i in 0..=MAX_HEADERS {
            h.insert(format!("h{i}"), json!(1));
        }
        assert_eq!(check_headers(&h), Err(MessageError::TooManyHeaders(257)));
        let h = headers(json!({"big": "v".repeat(MAX_HEADERS_BYTES)}));
        assert!(matches!(
            check_headers(&h),
            Err(MessageError::HeadersTooLarge(_))
        ));
        let h = headers(json!({"big": "v".repeat(MAX_HEADERS_BYTES - 3)}));
        assert_eq!(check_headers(&h), Ok(()));
    }
}
