//! W3C Trace Context across the system: the producer API puts a `traceparent` on each outbox row,
//! the relay sends it as an AMQP header, the consumer continues it. Log lines about a message carry
//! its `trace_id` and `message_id`; with OTLP export on (`OTEL_EXPORTER_OTLP_ENDPOINT`), spans are
//! exported with the message's trace as their parent.

use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The fields of a valid `traceparent` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent<'a> {
    pub trace_id: &'a str,
    pub parent_id: &'a str,
    pub flags: &'a str,
}

/// Parses `version-traceid-parentid-flags` (lower-case hex; version `ff` and all-zero ids are
/// invalid; versions above 00 may append fields, which are ignored).
pub fn parse(value: &str) -> Option<TraceParent<'_>> {
    let value = value.trim();
    let mut parts = value.splitn(5, '-');
    let (version, trace_id, parent_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let rest = parts.next();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && (version != "00" || rest.is_none())
        && hex(trace_id, 32)
        && trace_id.bytes().any(|b| b != b'0')
        && hex(parent_id, 16)
        && parent_id.bytes().any(|b| b != b'0')
        && hex(flags, 2);
    valid.then_some(TraceParent {
        trace_id,
        parent_id,
        flags,
    })
}

/// The trace id of a `traceparent`, when it is valid.
pub fn trace_id(traceparent: Option<&str>) -> Option<&str> {
    traceparent.and_then(parse).map(|p| p.trace_id)
}

/// Makes `span` a child of `traceparent` in exported traces (a no-op while OTLP export is off).
pub fn set_parent(span: &tracing::Span, traceparent: &str) {
    if !crate::telemetry::otlp_enabled() || parse(traceparent).is_none() {
        return;
    }
    use opentelemetry::propagation::TextMapPropagator;
    let mut carrier = std::collections::HashMap::new();
    carrier.insert("traceparent".to_string(), traceparent.to_string());
    let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(cx);
}

/// The `traceparent` of `span` when OTLP export is on (so downstream spans hang under it).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    if !crate::telemetry::otlp_enabled() {
        return None;
    }
    use opentelemetry::trace::TraceContextExt;
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_valid_and_rejects_invalid() {
        let p = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(p.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.parent_id, "00f067aa0ba902b7");
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
        assert_eq!(
            trace_id(Some(
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x"
            )),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
    }
}
