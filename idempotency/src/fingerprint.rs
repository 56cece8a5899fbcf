//! The fingerprint of a request: SHA-256 over the canonical JSON (object keys sorted bytewise, no
//! whitespace) of the operation, the request's method and target (path and query) and the
//! validated, normalized request. Key order, whitespace and whatever the service's normalization
//! folds (e.g. `"250"` and `250`) do not change it; the same body sent to another resource
//! (`POST /orders/1/cancel` and `/orders/2/cancel`) or with another method does.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Version of the fingerprint input; bump it when the canonical form changes.
pub const FINGERPRINT_VERSION: u32 = 2;

/// Canonical JSON: object keys sorted (bytewise), no whitespace, numbers and strings as
/// serde_json writes them. Independent of serde_json's `preserve_order` feature.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// The request line a fingerprint covers besides the body: its method and target.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub method: &'a str,
    /// Path and query as sent (`/orders/1/cancel?notify=true`).
    pub path_and_query: &'a str,
}

/// The fingerprints a stored record may hold for one request: this version's, and version 1's
/// (operation and request only), which records written before version 2 hold. A retry of such a
/// record still matches it, so a deploy never turns a replay into a 422.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprints {
    pub current: [u8; 32],
    pub v1: [u8; 32],
}

impl Fingerprints {
    pub fn of(operation: &str, target: Target<'_>, normalized_request: &Value) -> Self {
        Self {
            current: fingerprint(operation, target, normalized_request),
            v1: fingerprint_v1(operation, normalized_request),
        }
    }

    /// Whether `stored` is the fingerprint of this request, in either version.
    pub fn matches(&self, stored: &[u8]) -> bool {
        stored == self.current.as_slice() || stored == self.v1.as_slice()
    }
}

/// Version 1: the operation and the request, without method and target.
fn fingerprint_v1(operation: &str, normalized_request: &Value) -> [u8; 32] {
    let input = serde_json::json!({
        "v": 1,
        "operation": operation,
        "request": normalized_request,
    });
    Sha256::digest(canonical_json(&input).as_bytes()).into()
}

/// The fingerprint of `normalized_request` sent to `target` for `operation`.
pub fn fingerprint(operation: &str, target: Target<'_>, normalized_request: &Value) -> [u8; 32] {
    let input = serde_json::json!({
        "v": FINGERPRINT_VERSION,
        "operation": operation,
        "method": target.method,
        "target": target.path_and_query,
        "request": normalized_request,
    });
    Sha256::digest(canonical_json(&input).as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys_and_drops_whitespace() {
        let a: Value =
            serde_json::from_str(r#"{ "b": [1, {"y": 2, "x": "é"}], "a": null }"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"a":null,"b":[1,{"x":"é","y":2}]}"#).unwrap();
        assert_eq!(canonical_json(&a), r#"{"a":null,"b":[1,{"x":"é","y":2}]}"#);
        let fp = |operation, method, path_and_query, request: &Value| {
            let target = Target {
                method,
                path_and_query,
            };
            fingerprint(operation, target, request)
        };
        let base = fp("create_order", "POST", "/orders", &a);
        assert_eq!(base, fp("create_order", "POST", "/orders", &b));
        for other in [
            fp("create_payment", "POST", "/orders", &a),
            fp("create_order", "POST", "/orders?dry_run=true", &a),
            fp("create_order", "PUT", "/orders", &a),
        ] {
            assert_ne!(base, other);
        }
        let post = Target {
            method: "POST",
            path_and_query: "/orders",
        };
        // A record written by version 1 still matches the same request, and only it.
        let v1 = fingerprint_v1("create_order", &a);
        assert!(Fingerprints::of("create_order", post, &b).matches(&v1));
        assert!(!Fingerprints::of("create_payment", post, &b).matches(&v1));
    }
}
