//! Reading a process's JSON (as the API answers it) for the pages: text, times, step names.

use chrono::{DateTime, Utc};
use maud::{Markup, html};
use serde_json::Value;
use std::collections::HashMap;

/// A value of `v` as text ("" for null or missing).
pub fn txt(v: &Value, key: &str) -> String {
    match v.get(key) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// A time of `v`, if it has one.
pub fn time_of(v: &Value, key: &str) -> Option<DateTime<Utc>> {
    v.get(key)
        .and_then(|t| t.as_str())
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc))
}

/// A time as shown (UTC, to the second).
pub fn when(v: &Value, key: &str) -> String {
    time_of(v, key)
        .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_default()
}

/// A time in a crowded table: the time of day, the whole time on hover.
pub fn short(v: &Value, key: &str) -> Markup {
    match time_of(v, key) {
        Some(t) => html! {
            span title=(t.format("%Y-%m-%d %H:%M:%S%.3f UTC")) { (t.format("%H:%M:%S")) }
        },
        None => html! {},
    }
}

/// "name (role)" of each step, by its seq.
pub fn step_names(steps: &[Value]) -> HashMap<String, String> {
    steps
        .iter()
        .map(|st| {
            (
                txt(st, "seq"),
                format!("{} ({})", txt(st, "name"), txt(st, "role")),
            )
        })
        .collect()
}
