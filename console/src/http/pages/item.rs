//! What the page of one dead row and the page of one dead letter share: every header as a row of
//! its own, the body pretty-printed and as stored, and what operators did to the item.

use super::audit::audit_table;
use super::layout::shown;
use crate::actions::audit;
use maud::{Markup, html};
use serde_json::Value;

/// Every header of `headers` (an object) in a table with HTML id `id`; "none" without any.
pub fn headers_table(id: &str, headers: &Value) -> Markup {
    let rows: Vec<(String, String)> = headers
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let v = v
                        .as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| v.to_string());
                    (k.clone(), v)
                })
                .collect()
        })
        .unwrap_or_default();
    html! {
        @if rows.is_empty() {
            p { "none" }
        } @else {
            table id=(id) {
                tr { th { "name" } th { "value" } }
                @for (k, v) in &rows { tr { td { code { (shown(k)) } } td { code { (shown(v)) } } } }
            }
        }
    }
}

/// `body` pretty-printed (HTML id `<prefix>-pretty`), and folded as stored (`<prefix>-raw`,
/// under `stored`, e.g. "as received").
pub fn body(prefix: &str, stored: &str, body: &Value) -> Markup {
    let pretty = serde_json::to_string_pretty(body).unwrap_or_default();
    html! {
        pre id={ (prefix) "-pretty" } { (shown(&pretty)) }
        details { summary { (stored) } pre id={ (prefix) "-raw" } { (shown(&body.to_string())) } }
    }
}

/// What operators did to the item (HTML id `id`): "nothing yet", or the audit entries.
pub fn history(id: &str, entries: &[audit::Entry]) -> Markup {
    html! {
        h2 { "What operators did" }
        @if entries.is_empty() {
            p id=(id) { "nothing yet" }
        } @else {
            (audit_table(id, entries))
        }
    }
}
