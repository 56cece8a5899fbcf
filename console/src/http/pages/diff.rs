//! An audit entry's before → after as a person reads a change: one row per field (nested
//! objects by dotted path), the changed ones marked, a removed value struck through in red, an
//! added one in green, the unchanged ones plain; and the entry's target linked to its page.

use super::layout::shown;
use maud::{Markup, html};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Nested objects deeper than this are compared as whole values.
const DEPTH: usize = 3;

/// The fields of `v` by dotted path (a non-object is one field named "").
fn flatten(v: &Value) -> BTreeMap<String, Value> {
    fn walk(prefix: &str, m: &Map<String, Value>, depth: usize, out: &mut BTreeMap<String, Value>) {
        for (k, v) in m {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                Value::Object(inner) if depth < DEPTH && !inner.is_empty() => {
                    walk(&path, inner, depth + 1, out)
                }
                other => {
                    out.insert(path, other.clone());
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    match v {
        Value::Object(m) => walk("", m, 0, &mut out),
        Value::Null => {}
        other => {
            out.insert(String::new(), other.clone());
        }
    }
    out
}

/// The fields of `v` as the same small table, none marked: a value shown, not a change.
pub fn fields(v: &Value) -> Markup {
    diff(Some(v), Some(v))
}

/// The change from `before` to `after`, as a small table (nothing when both are empty).
pub fn diff(before: Option<&Value>, after: Option<&Value>) -> Markup {
    let (b, a) = (
        before.map(flatten).unwrap_or_default(),
        after.map(flatten).unwrap_or_default(),
    );
    let mut keys: Vec<&String> = b.keys().chain(a.keys()).collect();
    keys.sort();
    keys.dedup();
    if keys.is_empty() {
        return html! {};
    }
    let text = |v: &Value| {
        shown(
            &v.as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string()),
        )
    };
    html! {
        table.diff {
            @for k in keys {
                @let name = if k.is_empty() { "value" } else { k.as_str() };
                @match (b.get(k), a.get(k)) {
                    (Some(x), Some(y)) if x == y => tr.diff-same { td { (shown(name)) } td { (text(x)) } },
                    (Some(x), Some(y)) => tr.diff-changed {
                        td { (shown(name)) }
                        td { del.diff-removed { (text(x)) } " → " ins.diff-added { (text(y)) } }
                    },
                    (Some(x), None) => tr.diff-changed { td { (shown(name)) } td { del.diff-removed { (text(x)) } } },
                    (None, Some(y)) => tr.diff-changed { td { (shown(name)) } td { ins.diff-added { (text(y)) } } },
                    (None, None) => {},
                }
            }
        }
    }
}

/// An audit target as a link to its page, when it has one (`process:<id>` → the process page).
pub fn target_link(target: &str) -> Markup {
    let href = match target.split_once(':') {
        Some(("process", id)) if uuid::Uuid::parse_str(id).is_ok() => {
            Some(format!("/processes/{id}"))
        }
        Some(("outbox", _)) => Some("/#dead-rows".to_string()),
        Some(("dlq", _)) => Some("/dead-letters".to_string()),
        Some(("ordered", _)) => Some("/ordered".to_string()),
        Some(("approval", id)) if uuid::Uuid::parse_str(id).is_ok() => {
            Some(format!("/#approval-{id}"))
        }
        Some(("aggregate", id)) => Some(super::links::Links::messages(id)),
        _ => None,
    };
    html! {
        @match href {
            Some(h) => a.audit-target href=(h) { (shown(target)) },
            None => (shown(target)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn changed_fields_are_marked_removed_red_added_green() {
        let d = diff(
            Some(&json!({"status": "manual_review", "version": 3, "step": {"seq": 2}, "gone": 1})),
            Some(&json!({"status": "running", "version": 3, "step": {"seq": 2}, "new": "<b>"})),
        )
        .into_string();
        assert!(d.contains("<del class=\"diff-removed\">manual_review</del> → <ins class=\"diff-added\">running</ins>"), "{d}");
        assert!(d.contains("diff-same") && d.contains("step.seq"), "{d}");
        assert!(d.contains("<del class=\"diff-removed\">1</del>"), "{d}");
        assert!(
            d.contains("<ins class=\"diff-added\">&lt;b&gt;</ins>"),
            "{d}"
        );
        let link = target_link("process:0191c9a0-0000-7000-8000-000000000000").into_string();
        assert!(
            link.contains("href=\"/processes/0191c9a0-0000-7000-8000-000000000000\""),
            "{link}"
        );
        assert!(!target_link("process:x\"y").into_string().contains("href"));
    }
}
