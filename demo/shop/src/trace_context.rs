//! W3C Trace Context: the `traceparent` each outbox event carries. An incoming valid `traceparent`
//! is continued (same trace id and flags, a new span id for this service); otherwise a new trace
//! starts (sampled).

use axum::http::HeaderMap;

/// The `traceparent` for the events of this request.
pub fn continue_or_start(headers: &HeaderMap) -> String {
    let incoming = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(parse);
    let span = new_id::<8>();
    match incoming {
        Some(parent) => format!("00-{}-{span}-{}", parent.trace_id, parent.flags),
        None => format!("00-{}-{span}-01", new_id::<16>()),
    }
}

/// The span of one API request. It carries the trace id on every log line of the request and, once
/// the event is written, its message id. With OTLP export on, the span continues the incoming trace
/// and the events' `traceparent` points at it, so relay and consumer spans hang under this request.
pub fn request_span(headers: &HeaderMap, operation: &'static str) -> (tracing::Span, String) {
    let incoming = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .filter(|v| parse(v).is_some());
    let span = tracing::info_span!(
        "request",
        operation,
        trace_id = tracing::field::Empty,
        message_id = tracing::field::Empty,
    );
    if let Some(tp) = incoming {
        plumbing::trace::set_parent(&span, tp);
    }
    let traceparent =
        plumbing::trace::traceparent_of(&span).unwrap_or_else(|| continue_or_start(headers));
    if let Some(id) = shared::trace::trace_id(Some(&traceparent)) {
        span.record("trace_id", id);
    }
    (span, traceparent)
}

/// Parses a `traceparent` (the shared W3C rules: lower-case hex, no all-zero ids, version `ff`
/// invalid, fields after version 00 ignored).
pub use shared::trace::parse;

fn new_id<const N: usize>() -> String {
    loop {
        let bytes: [u8; N] = rand::random();
        if bytes.iter().any(|b| *b != 0) {
            return hex::encode(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `traceparent` for a request that came with `incoming`.
    fn continued(incoming: &str) -> String {
        let mut h = HeaderMap::new();
        h.insert("traceparent", incoming.parse().unwrap());
        continue_or_start(&h)
    }

    #[test]
    fn continues_a_valid_parent() {
        let tp = continued("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let p = parse(&tp).unwrap();
        assert_eq!(p.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(!tp.contains("00f067aa0ba902b7"));
    }

    /// Which values are invalid is shared::trace's rule (its tests list them); any of them, or
    /// none, starts a new trace.
    #[test]
    fn starts_a_new_trace_otherwise() {
        let tp = continue_or_start(&HeaderMap::new());
        assert!(parse(&tp).is_some(), "{tp}");
        let tp = continued("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra");
        let p = parse(&tp).unwrap();
        assert_ne!(p.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    }
}
