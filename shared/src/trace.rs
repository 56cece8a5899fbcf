//! W3C Trace Context: parsing the `traceparent` a producer puts on an outbox row (header
//! `traceparent`), which the relay sends as an AMQP header and the consumer continues. Linking
//! spans to it for export is in `plumbing::trace`.

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
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
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
