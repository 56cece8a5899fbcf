//! Text a person typed (a reason, a filter, evidence, a consumer name): it never carries control
//! characters. PostgreSQL refuses NUL in `text` and `jsonb`, so a NUL that reached a query was a
//! 500, and when it was in the reason of a denied attempt, the denial went unrecorded.
//!
//! Two rules: every text input is [`check`]ed, after the role check (so a refused caller is
//! audited first, whatever they sent), and answers 400 with a control character; and what the
//! audit log writes is [`printable`] (control characters spelled out as `\u{..}`), so writing an
//! audit entry never fails on its content.

use crate::error::ConsoleError;
use serde_json::Value;

/// Whether `c` is refused in text input: any Unicode control character (C0 with NUL, tab and line
/// breaks, DEL, C1). The console's inputs are single-line.
fn refused(c: char) -> bool {
    c.is_control()
}

/// `Ok` when `value` (the input named `field`) has no control character, else a 400.
pub fn check(field: &str, value: &str) -> Result<(), ConsoleError> {
    match value.chars().find(|c| refused(*c)) {
        None => Ok(()),
        Some(c) => Err(ConsoleError::BadRequest(format!(
            "{field} contains a control character (U+{:04X}); text inputs take none",
            c as u32
        ))),
    }
}

/// [`check`] on each `(field, value)` given.
pub fn check_all<'a>(
    inputs: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> Result<(), ConsoleError> {
    inputs
        .into_iter()
        .filter_map(|(f, v)| v.map(|v| (f, v)))
        .try_for_each(|(f, v)| check(f, v))
}

/// `s` with every control character spelled out (`\u{0}`): storable and readable.
pub fn printable(s: &str) -> String {
    if !s.chars().any(refused) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if refused(c) {
                format!("\\u{{{:x}}}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `v` with [`printable`] strings and keys, at any depth.
pub fn printable_value(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::String(printable(s)),
        Value::Array(a) => Value::Array(a.iter().map(printable_value).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| (printable(k), printable_value(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Percent-encodes `text` for a URL's path segment or query value.
pub fn url_encode(text: &str) -> String {
    let mut q = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            q.push(b as char);
        } else {
            q.push_str(&format!("%{b:02X}"));
        }
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_refused_and_spelled_out() {
        assert!(check("reason", "refund, INC-7 ✓").is_ok());
        for bad in ["a\0b", "tab\there", "line\nbreak", "del\u{7f}", "c1\u{85}"] {
            assert!(check("reason", bad).is_err(), "{bad:?}");
            assert!(!printable(bad).chars().any(char::is_control), "{bad:?}");
        }
        assert_eq!(printable("a\0b"), "a\\u{0}b");
        assert_eq!(
            printable_value(&serde_json::json!({"k\0": ["x\u{1}"]})),
            serde_json::json!({"k\\u{0}": ["x\\u{1}"]})
        );
    }
}
