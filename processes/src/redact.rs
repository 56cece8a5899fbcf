//! Only what is needed to resume or explain is stored for display: declared input fields are
//! replaced, error messages are cut and stripped of card-like digit runs.

use serde_json::Value;

/// What a redacted value is replaced with.
pub const MARK: &str = "[redacted]";

/// `input` with every declared field (top-level name or dotted path such as `card.number`)
/// replaced by [`MARK`]; arrays are walked, so `items.secret` redacts the field in each item.
pub fn input(input: &Value, fields: &[String]) -> Value {
    let mut out = input.clone();
    for f in fields {
        let path: Vec<&str> = f.split('.').collect();
        redact_path(&mut out, &path);
    }
    out
}

fn redact_path(v: &mut Value, path: &[&str]) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    match v {
        Value::Object(map) => {
            if let Some(child) = map.get_mut(*first) {
                if rest.is_empty() {
                    *child = Value::String(MARK.into());
                } else {
                    redact_path(child, rest);
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                redact_path(item, path);
            }
        }
        _ => {}
    }
}

/// Longest stored error message, in bytes.
pub const MAX_MESSAGE: usize = 500;

/// A message fit to store: control characters escaped, runs of 12 or more digits (card or
/// account numbers) masked, cut to [`MAX_MESSAGE`] bytes on a character boundary.
pub fn message(m: &str) -> String {
    let escaped = shared::display::escape_control(m);
    let mut out = String::with_capacity(escaped.len().min(MAX_MESSAGE));
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        if digits.len() >= 12 {
            out.push_str(MARK);
        } else {
            out.push_str(digits);
        }
        digits.clear();
    };
    for c in escaped.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            flush(&mut digits, &mut out);
            out.push(c);
        }
    }
    flush(&mut digits, &mut out);
    truncate(&out, MAX_MESSAGE)
}

/// `s` cut to at most `max` bytes on a character boundary.
pub use shared::display::truncate;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn redacts_declared_fields_only() {
        let v = json!({"amount": 5, "card": {"number": "4111", "exp": "12/30"}, "items": [{"secret": 1}, {"secret": 2}]});
        let r = input(
            &v,
            &["card.number".into(), "items.secret".into(), "absent".into()],
        );
        assert_eq!(
            r,
            json!({"amount": 5, "card": {"number": MARK, "exp": "12/30"}, "items": [{"secret": MARK}, {"secret": MARK}]})
        );
    }

    #[test]
    fn masks_card_like_numbers_and_cuts() {
        assert_eq!(
            message("card 4111111111111111 declined"),
            "card [redacted] declined"
        );
        assert_eq!(message("HTTP 503"), "HTTP 503");
        assert!(message(&"é".repeat(400)).len() <= MAX_MESSAGE);
    }
}
