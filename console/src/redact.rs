//! Redaction: what never leaves the console, in any page or API response.
//!
//! - values of declared secret fields (by JSON key, case-insensitive: `token`, `password`,
//!   `card_number`, ... plus `--secret-field`s), at any depth;
//! - card-like numbers: runs of 13 to 19 digits, also when grouped by single spaces or dashes;
//! - console tokens (`ct_` followed by 64 hex digits) and session ids.
//!
//! Applied to every value that comes from a row, a message or a request before it is rendered.

use serde_json::Value;
use std::sync::OnceLock;

/// What a redacted value is replaced with.
pub const MASK: &str = "[redacted]";

/// Field names redacted by default.
pub const DEFAULT_SECRET_FIELDS: &[&str] = &[
    "token",
    "access_token",
    "refresh_token",
    "api_key",
    "apikey",
    "authorization",
    "password",
    "secret",
    "card_number",
    "pan",
    "cvv",
    "cvc",
    "iban",
    "email",
    "phone",
];

static EXTRA_FIELDS: OnceLock<Vec<String>> = OnceLock::new();

/// Declares more secret field names (from configuration), once per process.
pub fn declare_secret_fields(fields: &[String]) {
    let _ = EXTRA_FIELDS.set(fields.iter().map(|f| f.to_ascii_lowercase()).collect());
}

fn is_secret_field(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    DEFAULT_SECRET_FIELDS.contains(&lower.as_str())
        || EXTRA_FIELDS
            .get()
            .is_some_and(|extra| extra.contains(&lower))
}

/// A JSON value with secret fields masked and every string passed through [`text`].
pub fn value(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = if is_secret_field(k) {
                        Value::String(MASK.into())
                    } else {
                        value(v)
                    };
                    (text(k), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(value).collect()),
        Value::String(s) => Value::String(text(s)),
        Value::Number(n) => {
            let digits = n.to_string();
            if digits.len() >= 13 && digits.bytes().all(|b| b.is_ascii_digit()) {
                Value::String(MASK.into())
            } else {
                v.clone()
            }
        }
        other => other.clone(),
    }
}

/// `s` with card-like numbers and console tokens masked.
pub fn text(s: &str) -> String {
    mask_tokens(&mask_card_numbers(s))
}

/// Masks runs of 13 to 19 digits, allowing one space or dash between digits.
fn mask_card_numbers(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_digit() && (i == 0 || !chars[i - 1].is_ascii_digit()) {
            // Extend over digits and single separators between digits.
            let mut j = i;
            let mut digits = 0;
            let mut end = i;
            while j < chars.len() {
                if chars[j].is_ascii_digit() {
                    digits += 1;
                    j += 1;
                    end = j;
                } else if (chars[j] == ' ' || chars[j] == '-')
                    && j + 1 < chars.len()
                    && chars[j + 1].is_ascii_digit()
                {
                    j += 1;
                } else {
                    break;
                }
            }
            // Part of a longer word (a UUID, a hex token, an identifier): not a card number.
            let alnum = |k: usize| chars.get(k).is_some_and(|c| c.is_ascii_alphanumeric());
            let glued_before =
                i > 0 && (alnum(i - 1) || (chars[i - 1] == '-' && i > 1 && alnum(i - 2)));
            let glued_after = alnum(end) || (chars.get(end) == Some(&'-') && alnum(end + 1));
            if (13..=19).contains(&digits) && !glued_before && !glued_after {
                out.push_str(MASK);
            } else {
                out.extend(&chars[i..end]);
            }
            i = end;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

/// Masks `ct_` + 64 hex digits (console tokens and session ids).
fn mask_tokens(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find("ct_") {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 3..];
        let hex_len = after.bytes().take_while(|b| b.is_ascii_hexdigit()).count();
        if hex_len >= 32 {
            out.push_str(MASK);
            rest = &after[hex_len..];
        } else {
            out.push_str("ct_");
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn masks_cards_tokens_and_declared_fields() {
        assert_eq!(text("card 4111111111111111 ok"), "card [redacted] ok");
        assert_eq!(text("4111 1111 1111 1111"), "[redacted]");
        assert_eq!(text("4111-1111-1111-1111!"), "[redacted]!");
        assert_eq!(text("order 123456789012"), "order 123456789012");
        // Digits inside UUIDs and hex tokens are not card numbers.
        for word in [
            "ab345678-1234-4234-8234-123456789012",
            "d0f23eb3-1234-5678-9012-3456789012ab",
            "f00d1234567890123456beef",
            "1234567890123456abcdef",
        ] {
            assert_eq!(text(word), word);
        }
        assert_eq!(text(&format!("t=ct_{}", "ab".repeat(32))), "t=[redacted]");
        let v = value(
            &json!({"a": {"Password": "x", "n": 4111111111111111u64, "list": ["5500 0000 0000 0004"]}, "amount": 12}),
        );
        assert_eq!(
            v,
            json!({"a": {"Password": MASK, "n": MASK, "list": [MASK]}, "amount": 12})
        );
    }
}
