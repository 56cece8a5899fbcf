//! The demo's replay marker: successful responses end with `"replayed":false}`; replays of them
//! (through [`idempotency::IdempotencyLayer::replay_body`]) say `true`, byte-identical otherwise.

const MARKER_FRESH: &str = "\"replayed\":false}";
const MARKER_REPLAYED: &str = "\"replayed\":true}";

/// The stored body with its replay marker set: byte-identical apart from `false` → `true`. Bodies
/// without a marker (stored errors, which hold only `error` or `errors`) are returned as stored.
pub fn mark_replayed(body: &str) -> String {
    match body.strip_suffix(MARKER_FRESH) {
        Some(prefix) => format!("{prefix}{MARKER_REPLAYED}"),
        None => body.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_marker() {
        assert_eq!(
            mark_replayed(r#"{"id":1,"replayed":false}"#),
            r#"{"id":1,"replayed":true}"#
        );
        assert_eq!(
            mark_replayed(r#"{"error":"order not found"}"#),
            r#"{"error":"order not found"}"#
        );
    }
}
