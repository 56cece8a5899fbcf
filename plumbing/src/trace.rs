//! Trace context across the system, for export: a message's span becomes a child of the trace in
//! its `traceparent` (parsed by [`shared::trace`]); with OTLP export on
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`), spans are exported with the message's trace as their parent.

use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Makes `span` a child of `traceparent` in exported traces (a no-op while OTLP export is off).
pub fn set_parent(span: &tracing::Span, traceparent: &str) {
    if !crate::telemetry::otlp_enabled() || shared::trace::parse(traceparent).is_none() {
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
