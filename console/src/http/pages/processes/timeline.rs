//! A process's timeline: its transitions (the processes crate's history) and the console's
//! actions on it (the audit log), in one table by time.

use super::values::{step_names, time_of, txt};
use crate::actions::audit;
use crate::http::pages::layout::shown;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use serde_json::Value;
use std::collections::HashMap;

/// A row and where it sorts: time, transitions before actions at the same time, then its id.
type Row = (DateTime<Utc>, u8, i64, Markup);

/// Transitions (the processes crate's history) and console actions (the audit log), by time.
pub fn timeline(v: &Value, steps: &[Value], entries: &[audit::Entry]) -> Markup {
    let names = step_names(steps);
    let mut rows: Vec<Row> = v["history"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| transition(t, &names))
        .collect();
    rows.extend(entries.iter().map(action));
    rows.sort_by_key(|r| (r.0, r.1, r.2));
    html! {
        table #timeline {
            tr {
                th { "when (UTC)" } th { "source" } th { "what" } th { "change / outcome" } th { "who" }
                th { "reason" } th {}
            }
            @for (_, _, _, row) in rows { (row) }
        }
    }
}

/// One transition of the history.
fn transition(t: &Value, names: &HashMap<String, String>) -> Row {
    let at = time_of(t, "at").unwrap_or(DateTime::<Utc>::MIN_UTC);
    let seq = txt(t, "step_seq");
    let from = txt(t, "from_status");
    let row = html! {
        tr.timeline-transition {
            td { (at.format("%Y-%m-%d %H:%M:%S%.3f")) }
            td { "transition" }
            td {
                @if seq.is_empty() { "process" } @else {
                    "step " (shown(&seq)) " " (shown(names.get(&seq).map(String::as_str).unwrap_or("")))
                }
            }
            td { @if !from.is_empty() { (shown(&from)) " → " } (shown(&txt(t, "to_status"))) }
            td { (shown(&txt(t, "actor"))) }
            td { (shown(&txt(t, "reason"))) }
            td {}
        }
    };
    (at, 0, t["id"].as_i64().unwrap_or(0), row)
}

/// One console action on the process.
fn action(e: &audit::Entry) -> Row {
    let row = html! {
        tr.timeline-action.audit-entry {
            td { (e.at.format("%Y-%m-%d %H:%M:%S%.3f")) }
            td { "console" }
            td { (shown(&e.action)) }
            td.outcome { (shown(&e.outcome)) }
            td { (shown(&e.actor_name)) " (" (shown(&e.roles.join(","))) ")" }
            td { (shown(&e.reason)) }
            td { @if let Some(a) = &e.approver { "approver " (shown(a)) } }
        }
    };
    (e.at, 1, e.seq, row)
}
