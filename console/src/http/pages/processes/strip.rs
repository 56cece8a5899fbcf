//! The step strip at the top of a process page: what a person would draw of the process, as
//! server-side SVG (the content security policy allows no script, and none is needed).
//!
//! - One box per step in its status colour ([`crate::http::pages::badge::colour`]), the word
//!   written in it; a compensation is named for what it does ("refund", from the definition's
//!   label; "undo <step>" without one).
//! - Below, a lane per step on a folded time axis: each attempt a tick, coloured by how it ended.
//!   Waits, timers and backoffs are one segment each (a retried charge is a row of ticks, not 30
//!   table rows); the axis gives each gap a width that grows with the logarithm of its length,
//!   and a gap over a minute is folded: drawn as a break with its duration written on it.
//! - Operator actions (the console's audit entries on the process: rerun, resolve, approvals) are
//!   marked on a lane of their own.
//!
//! Every mark has a `<title>` (hover) with its time and words. The full history table stays
//! below, in a `<details>`.

use super::values::{time_of, txt};
use crate::actions::audit;
use crate::http::pages::badge::colour;
use crate::http::pages::layout::shown;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use serde_json::Value;
use std::collections::HashMap;

/// Width of the lanes' labels, of the plot, of a step box; height of a lane.
const LABEL_W: f64 = 170.0;
const PLOT_W: f64 = 880.0;
const BOX_H: f64 = 46.0;
const LANE_H: f64 = 24.0;
/// The operator lane is taller: its labels take up to [`OP_ROWS`] rows, so that actions close in
/// time do not print over each other (issue 40, bug 6).
const OP_ROWS: usize = 3;
const OP_ROW_H: f64 = 12.0;
const OP_LANE_H: f64 = OP_ROW_H * OP_ROWS as f64 + 6.0;
/// Width of one character of a label (font-size 10), a little generous.
const OP_CHAR_W: f64 = 6.0;
/// A gap longer than this (seconds) is folded.
const FOLD_SECONDS: f64 = 60.0;

/// The strip of process `v` (its JSON view), its console actions `entries`, and the labels of
/// its compensations by step seq.
pub fn strip(v: &Value, entries: &[audit::Entry], labels: &HashMap<i32, String>) -> Markup {
    let steps: Vec<Value> = v["steps"].as_array().cloned().unwrap_or_default();
    let history: Vec<Value> = v["history"].as_array().cloned().unwrap_or_default();
    let now = Utc::now();
    let end = time_of(v, "finished_at").unwrap_or(now);
    let mut times: Vec<DateTime<Utc>> = history.iter().filter_map(|h| time_of(h, "at")).collect();
    times.extend(entries.iter().map(|e| e.at));
    times.push(end);
    let axis = Axis::new(times);
    let lanes_top = BOX_H + 24.0;
    let steps_top = lanes_top + OP_LANE_H;
    let height = steps_top + LANE_H * steps.len() as f64 + 34.0;
    let total_w = LABEL_W + PLOT_W + 20.0;
    html! {
        svg #strip xmlns="http://www.w3.org/2000/svg" role="img" width=(total_w) height=(height)
            viewBox={ "0 0 " (total_w) " " (height) } {
            title { "Step strip: each step's status, its attempts on a folded time axis, operator actions" }
            (boxes(&steps, labels, total_w))
            (operator_lane(entries, &axis, lanes_top))
            @for (i, st) in steps.iter().enumerate() {
                (lane(st, &history, &axis, steps_top + LANE_H * i as f64, labels, &steps, end))
            }
            (axis.draw(steps_top + LANE_H * steps.len() as f64 + 6.0))
        }
    }
}

/// What a step is called on the strip: its name, or for a compensation what it does.
fn step_label(st: &Value, labels: &HashMap<i32, String>, steps: &[Value]) -> String {
    let seq = st["seq"].as_i64().unwrap_or(-1) as i32;
    if txt(st, "role") != "compensation" {
        return shown(&txt(st, "name"));
    }
    if let Some(l) = labels.get(&seq) {
        return shown(l);
    }
    let undone = steps
        .iter()
        .find(|o| o["seq"] == st["acts_on"])
        .map(|o| txt(o, "name"))
        .unwrap_or_else(|| txt(st, "name"));
    format!("undo {}", shown(&undone))
}

/// The row of step boxes, each linking to its row in the steps table.
fn boxes(steps: &[Value], labels: &HashMap<i32, String>, total_w: f64) -> Markup {
    let n = steps.len().max(1) as f64;
    let w = ((total_w - 10.0) / n - 8.0).min(190.0);
    html! {
        @for (i, st) in steps.iter().enumerate() {
            @let seq = txt(st, "seq");
            @let status = txt(st, "status");
            @let x = 4.0 + i as f64 * (w + 8.0);
            @let label = step_label(st, labels, steps);
            a href={ "#step-" (seq) } {
                g.strip-step id={ "strip-step-" (seq) } data-status=(status) {
                    title { (label) " (step " (seq) "): " (status) ", " (txt(st, "attempts")) " attempts" }
                    rect x=(x) y="2" width=(w) height=(BOX_H) rx="5" fill=(colour(&status)) {}
                    text x=(x + 7.0) y="20" fill="#fff" font-size="13" font-weight="bold" { (clip(&label, w)) }
                    text x=(x + 7.0) y="38" fill="#fff" font-size="11" {
                        (clip(&format!("{status} · {}×", txt(st, "attempts")), w * 1.2))
                    }
                }
            }
        }
    }
}

/// Text cut to fit about `w` pixels.
fn clip(s: &str, w: f64) -> String {
    let max = ((w - 10.0) / 7.5).max(3.0) as usize;
    if s.chars().count() <= max {
        s.to_string()
    } else {
        format!(
            "{}…",
            s.chars().take(max.saturating_sub(1)).collect::<String>()
        )
    }
}

/// The row (0 at the top) of each label that starts at `x` and is `w` wide, in order of `x`: the
/// first row where it clears the label before it by a few pixels, or `None` when no row has
/// room (the mark stays, its words in its `<title>` and the history).
fn label_rows(labels: &[(f64, f64)], rows: usize) -> Vec<Option<usize>> {
    let mut right = vec![f64::NEG_INFINITY; rows];
    labels
        .iter()
        .map(|&(x, w)| {
            let row = right.iter().position(|&r| r + 4.0 <= x)?;
            right[row] = x + w;
            Some(row)
        })
        .collect()
}

/// The lane of operator actions: a diamond per console audit entry, its label in the first of
/// [`OP_ROWS`] rows with room.
fn operator_lane(entries: &[audit::Entry], axis: &Axis, y: f64) -> Markup {
    let mid = y + OP_LANE_H / 2.0;
    let mut marks: Vec<(f64, &audit::Entry, String)> = entries
        .iter()
        .map(|e| (axis.x(e.at), e, short_action(&e.action)))
        .collect();
    marks.sort_by(|a, b| a.0.total_cmp(&b.0));
    let rows = label_rows(
        &marks
            .iter()
            .map(|(x, _, label)| (x + 7.0, label.chars().count() as f64 * OP_CHAR_W))
            .collect::<Vec<_>>(),
        OP_ROWS,
    );
    html! {
        text x="4" y=(mid + 4.0) font-size="12" fill="#333" { "operator actions" }
        line x1=(LABEL_W) x2=(LABEL_W + PLOT_W) y1=(mid) y2=(mid) stroke="#ddd" {}
        @for ((x, e, label), row) in marks.iter().zip(&rows) {
            g.op-mark data-action=(shown(&e.action)) {
                title {
                    (e.at.format("%H:%M:%S%.3f")) " " (shown(&e.action)) " by " (shown(&e.actor_name))
                    ": " (shown(&e.outcome)) " — " (shown(&e.reason))
                }
                path d={ "M" (x) " " (mid - 7.0) " l6 7 l-6 7 l-6 -7 z" } fill=(colour(&e.outcome)) stroke="#222" stroke-width="0.7" {}
                @if let Some(row) = row {
                    text.op-label x=(x + 7.0) y=(y + OP_ROW_H * (*row as f64 + 1.0)) font-size="10" fill="#222" { (label) }
                }
            }
        }
    }
}

/// An audit action without its target prefix (`process.rerun_step` → `rerun_step`).
fn short_action(action: &str) -> String {
    shown(action.rsplit('.').next().unwrap_or(action))
}

/// A step's lane: its attempts as ticks, its waits, backoffs and reviews as folded segments.
fn lane(
    st: &Value,
    history: &[Value],
    axis: &Axis,
    y: f64,
    labels: &HashMap<i32, String>,
    steps: &[Value],
    end: DateTime<Utc>,
) -> Markup {
    let seq = st["seq"].as_i64();
    let mine: Vec<(DateTime<Utc>, String)> = history
        .iter()
        .filter(|h| h["step_seq"].as_i64() == seq && seq.is_some())
        .filter_map(|h| Some((time_of(h, "at")?, txt(h, "to_status"))))
        .collect();
    let waits = matches!(txt(st, "execution").as_str(), "wait" | "timer");
    let segments = segments(&mine, waits, end);
    let mid = y + LANE_H / 2.0;
    let attempts = txt(st, "attempts");
    html! {
        g.strip-lane id={ "strip-lane-" (txt(st, "seq")) } {
            text x="4" y=(mid + 4.0) font-size="12" fill="#333" {
                (clip(&step_label(st, labels, steps), LABEL_W - 40.0)) " · " (attempts) "×"
            }
            line x1=(LABEL_W) x2=(LABEL_W + PLOT_W) y1=(mid) y2=(mid) stroke="#eee" {}
            @for s in &segments { (s.draw(axis, mid)) }
        }
    }
}

/// A stretch of a step's life between two of its transitions.
struct Segment {
    kind: SegmentKind,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    /// The status it ended in (an attempt's outcome), or `None` while it lasts.
    ended: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SegmentKind {
    /// One run of the step: a tick at its start.
    Attempt,
    /// A wait for an event or a timer: one folded segment.
    Wait,
    /// Waiting to retry.
    Backoff,
    /// Waiting for a person.
    Review,
}

/// The segments of a step's transitions (`to_status` by time).
fn segments(mine: &[(DateTime<Utc>, String)], waits: bool, end: DateTime<Utc>) -> Vec<Segment> {
    let mut out = Vec::new();
    for (i, (at, status)) in mine.iter().enumerate() {
        let next = mine.get(i + 1);
        let after_run = i > 0 && mine[i - 1].1 == "running";
        let kind = match status.as_str() {
            "running" if waits => SegmentKind::Wait,
            "running" => SegmentKind::Attempt,
            "retryable" => SegmentKind::Backoff,
            "manual_review" => SegmentKind::Review,
            // A local step runs and commits in one transaction: it ends without a recorded
            // `running`, and that end is its attempt.
            "succeeded" | "failed" if !after_run => {
                out.push(Segment {
                    kind: SegmentKind::Attempt,
                    from: *at,
                    to: *at,
                    ended: Some(status.clone()),
                });
                continue;
            }
            _ => continue,
        };
        out.push(Segment {
            kind,
            from: *at,
            to: next.map(|n| n.0).unwrap_or(end),
            ended: next.map(|n| n.1.clone()),
        });
        // A wait's running is also an attempt (the step started waiting).
        if kind == SegmentKind::Wait {
            out.push(Segment {
                kind: SegmentKind::Attempt,
                from: *at,
                to: *at,
                ended: next.map(|n| n.1.clone()),
            });
        }
    }
    out
}

impl Segment {
    fn draw(&self, axis: &Axis, mid: f64) -> Markup {
        let (x1, x2) = (axis.x(self.from), axis.x(self.to));
        let span = duration(self.from, self.to);
        let ended = self.ended.as_deref().unwrap_or("running");
        let when = self.from.format("%H:%M:%S%.3f");
        match self.kind {
            SegmentKind::Attempt => html! {
                g.tick data-outcome=(ended) {
                    title { "attempt at " (when) " → " (ended) }
                    rect x=(x1 - 2.0) y=(mid - 8.0) width="4" height="16" fill=(colour(ended)) {}
                }
            },
            kind => {
                let (word, fill) = match kind {
                    SegmentKind::Wait => ("wait", "#9ab8e6"),
                    SegmentKind::Review => ("review", "#f4c27a"),
                    _ => ("backoff", "#cfcfcf"),
                };
                let class = format!("fold fold-{word}");
                html! {
                    g class=(class) {
                        title { (word) " from " (when) ": " (span) @if self.ended.is_none() { " so far" } }
                        rect x=(x1) y=(mid - 4.0) width=((x2 - x1).max(2.0)) height="8" rx="3" fill=(fill) {}
                        @if x2 - x1 > 46.0 && kind != SegmentKind::Backoff {
                            text x=((x1 + x2) / 2.0) y=(mid + 15.0) font-size="10" text-anchor="middle" fill="#333" {
                                (word) " " (span)
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A duration as a person reads it, to the second ("4m 12s"), or in ms under a second.
fn duration(from: DateTime<Utc>, to: DateTime<Utc>) -> String {
    let ms = (to - from).num_milliseconds().max(0);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    humantime::format_duration(std::time::Duration::from_secs((ms / 1000) as u64)).to_string()
}

/// The folded time axis: the distinct times of the process in order, each gap as wide as the
/// logarithm of its length allows.
struct Axis {
    times: Vec<DateTime<Utc>>,
    xs: Vec<f64>,
}

impl Axis {
    fn new(mut times: Vec<DateTime<Utc>>) -> Self {
        times.sort();
        times.dedup();
        let gaps: Vec<f64> = times
            .windows(2)
            .map(|w| ((w[1] - w[0]).num_milliseconds().max(0) as f64 / 1000.0 + 1.0).ln() + 0.05)
            .collect();
        let total: f64 = gaps.iter().sum();
        let scale = if total > 0.0 {
            (PLOT_W - 10.0) / total
        } else {
            0.0
        };
        let mut xs = vec![LABEL_W + 5.0];
        for g in gaps {
            let last = xs.last().copied().unwrap_or(LABEL_W);
            xs.push(last + g * scale);
        }
        Self { times, xs }
    }

    /// Where time `t` is drawn (between the neighbouring known times for an unknown one).
    fn x(&self, t: DateTime<Utc>) -> f64 {
        match self.times.binary_search(&t) {
            Ok(i) => self.xs[i],
            Err(0) => self.xs.first().copied().unwrap_or(LABEL_W),
            Err(i) if i >= self.times.len() => self.xs.last().copied().unwrap_or(LABEL_W),
            Err(i) => (self.xs[i - 1] + self.xs[i]) / 2.0,
        }
    }

    /// The axis line, the first and last times, and a break with its length on every folded gap.
    fn draw(&self, y: f64) -> Markup {
        let (Some(first), Some(last)) = (self.times.first(), self.times.last()) else {
            return html! {};
        };
        let folds = self
            .times
            .windows(2)
            .zip(self.xs.windows(2))
            .filter(|(t, _)| (t[1] - t[0]).num_milliseconds() as f64 / 1000.0 > FOLD_SECONDS);
        html! {
            line x1=(LABEL_W) x2=(LABEL_W + PLOT_W) y1=(y) y2=(y) stroke="#888" {}
            text x="4" y=(y + 4.0) font-size="11" fill="#555" { "time (UTC, folded)" }
            text x=(LABEL_W) y=(y + 16.0) font-size="10" fill="#555" { (first.format("%H:%M:%S")) }
            text x=(LABEL_W + PLOT_W) y=(y + 16.0) font-size="10" fill="#555" text-anchor="end" {
                (last.format("%H:%M:%S"))
            }
            @for (t, x) in folds {
                @let mx = (x[0] + x[1]) / 2.0;
                g.axis-fold {
                    title { "folded: " (duration(t[0], t[1])) " between " (t[0].format("%H:%M:%S")) " and " (t[1].format("%H:%M:%S")) }
                    path d={ "M" (mx - 5.0) " " (y + 5.0) " l4 -10 M" (mx + 1.0) " " (y + 5.0) " l4 -10" } stroke="#555" stroke-width="1.5" {}
                    text x=(mx) y=(y + 26.0) font-size="10" fill="#555" text-anchor="middle" { "≈ " (duration(t[0], t[1])) }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn at(s: i64) -> String {
        (DateTime::<Utc>::UNIX_EPOCH + chrono::TimeDelta::seconds(1_800_000_000 + s)).to_rfc3339()
    }

    #[test]
    fn labels_close_in_time_take_the_next_row_and_never_overlap() {
        // Three at one place, a fourth too, one further on that fits the first row again.
        let labels = [
            (100.0, 60.0),
            (101.0, 60.0),
            (102.0, 60.0),
            (103.0, 60.0),
            (170.0, 30.0),
        ];
        assert_eq!(
            label_rows(&labels, 3),
            [Some(0), Some(1), Some(2), None, Some(0)]
        );
        assert_eq!(label_rows(&[], 3), Vec::<Option<usize>>::new());
    }

    #[test]
    fn a_retried_charge_is_one_lane_of_ticks_and_its_refund_is_named() {
        let mut history = vec![json!({"step_seq": null, "to_status": "running", "at": at(0)})];
        for i in 0..15 {
            history.push(json!({"step_seq": 1, "to_status": "running", "at": at(i * 10)}));
            history.push(json!({"step_seq": 1, "to_status": "retryable", "at": at(i * 10 + 1)}));
        }
        history.push(json!({"step_seq": 2, "to_status": "pending", "at": at(400)}));
        let v = json!({
            "steps": [
                {"seq": 1, "name": "charge", "role": "forward", "status": "failed", "attempts": 15, "execution": "external"},
                {"seq": 2, "name": "charge", "role": "compensation", "acts_on": 1, "status": "pending", "attempts": 0, "execution": "external"},
                {"seq": 3, "name": "reserve", "role": "compensation", "acts_on": 0, "status": "pending", "attempts": 0, "execution": "local"},
            ],
            "history": history,
            "finished_at": at(500),
        });
        let labels = HashMap::from([(2, "refund".to_string())]);
        let svg = strip(&v, &[], &labels).into_string();
        assert_eq!(svg.matches("class=\"tick\"").count(), 15, "{svg}");
        assert_eq!(svg.matches("fold fold-backoff").count(), 15, "{svg}");
        assert!(svg.contains(">refund<"), "{svg}");
        assert!(
            svg.contains("undo reserve"),
            "a compensation without a label: {svg}"
        );
        assert!(
            svg.contains("axis-fold"),
            "the 5-minute gap is folded: {svg}"
        );
    }
}
