//! CloudEvents binary content mode: the event's attributes as `cloudEvents_*` headers.
//!
//! The CloudEvents AMQP binding puts attributes in AMQP 1.0 application properties named
//! `cloudEvents_<attribute>` and leaves the body as the event's data, its `content-type` as
//! `datacontenttype`. RabbitMQ 4.x turns AMQP 0.9.1 headers that do not start with `x-` into
//! application properties, so these headers make every published message a valid binary-mode
//! CloudEvent for AMQP 1.0 clients and CloudEvents SDKs, while the body, the content type and the
//! relay's other headers stay exactly as they were: today's consumers see no difference.
//!
//! Opt-in per exchange (`RELAY_CLOUDEVENTS=binary`): every relay publishing to one exchange must
//! use the same setting, or some of its messages would be CloudEvents and some not.

use crate::store::OutboxRow;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

/// Whether the relay adds CloudEvents attributes to what it publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Mode {
    /// Publish as before: no `cloudEvents_*` headers.
    #[default]
    Off,
    /// Binary content mode: attributes as `cloudEvents_*` headers, the body untouched.
    Binary,
}

/// Header names of the attributes the relay sets (AMQP binding, `cloudEvents_` prefix).
pub mod headers {
    pub const SPECVERSION: &str = "cloudEvents_specversion";
    pub const ID: &str = "cloudEvents_id";
    pub const SOURCE: &str = "cloudEvents_source";
    pub const TYPE: &str = "cloudEvents_type";
    pub const TIME: &str = "cloudEvents_time";
    /// Partitioning extension: the aggregate id, the key that orders events.
    pub const PARTITIONKEY: &str = "cloudEvents_partitionkey";
    /// Sequence extension: the per-aggregate sequence, zero-padded (compared as a string).
    pub const SEQUENCE: &str = "cloudEvents_sequence";
    /// Distributed tracing extension: W3C trace context, copied from the row's own headers.
    pub const TRACEPARENT: &str = "cloudEvents_traceparent";
    pub const TRACESTATE: &str = "cloudEvents_tracestate";
}

/// The CloudEvents version the headers follow.
pub const SPECVERSION: &str = "1.0";

/// Longest header value sent, in bytes: the limit of RabbitMQ 4.x's conversion of AMQP 0.9.1
/// string headers to AMQP 1.0 strings (as the 4.x review of issue 26 found it; RabbitMQ 3.10 on
/// the test machine cannot show it). A longer attribute might not reach AMQP 1.0 clients intact,
/// so such a row is refused instead of published as a broken CloudEvent.
pub const MAX_STRING_BYTES: usize = 4096;

/// Digits of `cloudEvents_sequence`: a positive signed 64-bit integer has at most 19, so every
/// value pads to the same width and string order is numeric order, as the extension requires.
pub const SEQUENCE_DIGITS: usize = 20;

/// Bytes kept as they are in a source path segment: RFC 3986 unreserved characters. Everything
/// else, `/` included, is percent-encoded, so an aggregate id can never add a path segment.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Why a source base or type prefix is refused at start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error("the CloudEvents source base must not be empty")]
    EmptySource,
    #[error(
        "the CloudEvents source base {0:?} is not a URI-reference without query or fragment (character {1:?})"
    )]
    SourceNotUri(String, char),
    #[error("the CloudEvents source base {0:?} has a bad percent-escape")]
    SourceBadEscape(String),
    #[error("the CloudEvents type prefix must not contain control characters")]
    PrefixControl,
    #[error("the CloudEvents {what} takes {bytes} bytes, more than {max}")]
    TooLong {
        what: &'static str,
        bytes: usize,
        max: usize,
    },
}

/// Why one row cannot be published as a CloudEvent (the row goes dead with this reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttributeError {
    #[error(
        "its CloudEvents header {header} would take {bytes} bytes, more than the {MAX_STRING_BYTES} RabbitMQ converts to an AMQP 1.0 string"
    )]
    TooLong { header: &'static str, bytes: usize },
    #[error("its aggregate_seq {0} is not positive, so it has no CloudEvents sequence")]
    Sequence(i64),
}

/// Settings of binary mode, checked once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binary {
    /// Source base without a trailing `/`; `<base>/<aggregate_type>/<aggregate_id>` is the source.
    source_base: String,
    /// Put before the event type to make the CloudEvents `type` (e.g. `com.example.`).
    type_prefix: String,
}

impl Binary {
    /// Checks `source_base` (a URI-reference such as `/outbox` or `https://orders.example/outbox`,
    /// no query or fragment, since the aggregate is appended as path segments) and `type_prefix`.
    pub fn new(source_base: &str, type_prefix: &str) -> Result<Self, SettingError> {
        let base = source_base.trim_end_matches('/');
        if source_base.is_empty() {
            return Err(SettingError::EmptySource);
        }
        if let Some(c) = source_base.chars().find(|c| !is_uri_char(*c)) {
            return Err(SettingError::SourceNotUri(source_base.into(), c));
        }
        if !escapes_are_valid(source_base) {
            return Err(SettingError::SourceBadEscape(source_base.into()));
        }
        // Leaves room for the aggregate in every source; an id alone can still make it too long.
        for (what, value, max) in [
            ("source base", base, 1024),
            ("type prefix", type_prefix, 1024),
        ] {
            if value.len() > max {
                return Err(SettingError::TooLong {
                    what,
                    bytes: value.len(),
                    max,
                });
            }
        }
        if type_prefix.chars().any(char::is_control) {
            return Err(SettingError::PrefixControl);
        }
        Ok(Self {
            source_base: base.into(),
            type_prefix: type_prefix.into(),
        })
    }

    /// The attributes of `row` as (header name, value) pairs, every value checked against
    /// [`MAX_STRING_BYTES`]. `created_rfc3339` is the row's `created_at` as the relay formats it.
    pub fn attributes(
        &self,
        row: &OutboxRow,
        created_rfc3339: &str,
    ) -> Result<Vec<(&'static str, String)>, AttributeError> {
        if row.aggregate_seq < 1 {
            return Err(AttributeError::Sequence(row.aggregate_seq));
        }
        let mut out = Vec::with_capacity(9);
        out.push((headers::SPECVERSION, SPECVERSION.to_owned()));
        out.push((headers::ID, row.id.hyphenated().to_string()));
        out.push((headers::SOURCE, self.source(row)));
        out.push((
            headers::TYPE,
            format!("{}{}", self.type_prefix, row.event_type),
        ));
        out.push((headers::TIME, created_rfc3339.to_owned()));
        if !row.aggregate_id.is_empty() {
            out.push((headers::PARTITIONKEY, row.aggregate_id.clone()));
        }
        out.push((
            headers::SEQUENCE,
            format!("{:0width$}", row.aggregate_seq, width = SEQUENCE_DIGITS),
        ));
        for (name, header) in [
            ("traceparent", headers::TRACEPARENT),
            ("tracestate", headers::TRACESTATE),
        ] {
            if let Some(value) = row.headers.get(name).and_then(|v| v.as_str()) {
                out.push((header, value.to_owned()));
            }
        }
        if let Some((header, value)) = out.iter().find(|(_, v)| v.len() > MAX_STRING_BYTES) {
            return Err(AttributeError::TooLong {
                header,
                bytes: value.len(),
            });
        }
        Ok(out)
    }

    /// `<base>/<aggregate_type>/<aggregate_id>`, each segment percent-encoded.
    fn source(&self, row: &OutboxRow) -> String {
        format!(
            "{}/{}/{}",
            self.source_base,
            segment(&row.aggregate_type),
            segment(&row.aggregate_id)
        )
    }
}

/// One path segment: unreserved characters kept, the rest percent-encoded; `.` and `..` encoded
/// too, since a URI resolver would remove them as dot-segments.
fn segment(s: &str) -> String {
    match s {
        "." => "%2E".into(),
        ".." => "%2E%2E".into(),
        _ => utf8_percent_encode(s, SEGMENT).to_string(),
    }
}

/// RFC 3986 characters of a URI-reference, less `?` and `#` (the aggregate goes after the base).
fn is_uri_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-._~:/[]@!$&'()*+,;=%".contains(c)
}

/// Every `%` starts a two-digit hex escape.
fn escapes_are_valid(s: &str) -> bool {
    let b = s.as_bytes();
    b.iter().enumerate().all(|(i, &c)| {
        c != b'%'
            || (b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{TimeZone, Utc};
    use serde_json::json;

    fn row(aggregate_id: &str) -> OutboxRow {
        OutboxRow {
            seq: 1,
            id: uuid::Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            aggregate_seq: 7,
            event_type: "order.placed".into(),
            payload: "{}".into(),
            headers: json!({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            created_at: Utc.with_ymd_and_hms(2026, 12, 1, 10, 0, 0).unwrap(),
            attempts: 0,
            partition: 0,
        }
    }

    #[test]
    fn maps_the_row_to_attributes() {
        let b = Binary::new("https://orders.example/outbox/", "com.example.").unwrap();
        let a = b.attributes(&row("o 1/ä"), "T").unwrap();
        let get = |n: &str| a.iter().find(|(h, _)| *h == n).map(|(_, v)| v.as_str());
        assert_eq!(get(headers::SPECVERSION), Some("1.0"));
        assert_eq!(
            get(headers::ID),
            Some("00000000-0000-0000-0000-000000000000")
        );
        assert_eq!(
            get(headers::SOURCE),
            Some("https://orders.example/outbox/order/o%201%2F%C3%A4")
        );
        assert_eq!(get(headers::TYPE), Some("com.example.order.placed"));
        assert_eq!(get(headers::TIME), Some("T"));
        assert_eq!(get(headers::PARTITIONKEY), Some("o 1/ä"));
        assert_eq!(get(headers::SEQUENCE), Some("00000000000000000007"));
        assert_eq!(
            get(headers::TRACEPARENT),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        assert_eq!(get(headers::TRACESTATE), Some("k=v"));
    }

    #[test]
    fn empty_id_has_no_partition_key_and_dot_segments_are_escaped() {
        let b = Binary::new("/outbox", "").unwrap();
        let mut r = row("");
        r.headers.clear();
        let a = b.attributes(&r, "T").unwrap();
        assert!(a.iter().all(|(h, _)| *h != headers::PARTITIONKEY));
        assert!(a.iter().all(|(h, _)| *h != headers::TRACEPARENT));
        assert!(a.contains(&(headers::SOURCE, "/outbox/order/".into())));
        let a = b.attributes(&row(".."), "T").unwrap();
        assert!(a.contains(&(headers::SOURCE, "/outbox/order/%2E%2E".into())));
    }

    #[test]
    fn sequence_sorts_as_a_string_like_a_number() {
        let b = Binary::new("/o", "").unwrap();
        let seq = |n: i64| {
            let mut r = row("a");
            r.aggregate_seq = n;
            b.attributes(&r, "T")
                .unwrap()
                .into_iter()
                .find(|(h, _)| *h == headers::SEQUENCE)
                .map(|(_, v)| v)
                .unwrap()
        };
        assert!(seq(9) < seq(10));
        assert_eq!(seq(i64::MAX).len(), SEQUENCE_DIGITS);
        let mut r = row("a");
        r.aggregate_seq = 0;
        assert_eq!(b.attributes(&r, "T"), Err(AttributeError::Sequence(0)));
    }

    #[test]
    fn refuses_attributes_over_the_conversion_limit() {
        // The longest aggregate the door accepts fits under the default base (each byte of it
        // percent-encodes to three)...
        let b = Binary::new("/outbox", "").unwrap();
        let mut longest = row(&"/".repeat(shared::publishable::MAX_AGGREGATE_ID_BYTES));
        longest.aggregate_type = "€".repeat(85);
        assert!(b.attributes(&longest, "T").is_ok());
        // ...but not under a long base.
        let long = Binary::new(&format!("/{}", "b".repeat(1000)), "").unwrap();
        let err = long.attributes(&longest, "T").unwrap_err();
        assert!(
            matches!(err, AttributeError::TooLong { header: headers::SOURCE, bytes } if bytes > MAX_STRING_BYTES),
            "{err}"
        );
        let mut r = row("a");
        r.headers
            .insert("tracestate".into(), json!("x".repeat(MAX_STRING_BYTES + 1)));
        assert_eq!(
            b.attributes(&r, "T"),
            Err(AttributeError::TooLong {
                header: headers::TRACESTATE,
                bytes: MAX_STRING_BYTES + 1
            })
        );
    }

    #[test]
    fn settings_are_checked() {
        assert_eq!(Binary::new("", ""), Err(SettingError::EmptySource));
        assert!(matches!(
            Binary::new("/a?b", ""),
            Err(SettingError::SourceNotUri(_, '?'))
        ));
        assert!(matches!(
            Binary::new("/a b", ""),
            Err(SettingError::SourceNotUri(_, ' '))
        ));
        assert!(matches!(
            Binary::new("/a%2", ""),
            Err(SettingError::SourceBadEscape(_))
        ));
        assert_eq!(Binary::new("/o", "a\nb"), Err(SettingError::PrefixControl));
        assert!(Binary::new("urn:example:outbox", "").is_ok());
        assert!(Binary::new("/", "").is_ok());
    }
}
