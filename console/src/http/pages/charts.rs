//! Small line charts drawn on the server as SVG (no script, no framework): one series over the
//! last hour, its latest value, its maximum, and a link to the matching Grafana panel when one
//! is configured.

use crate::targets::samples::Series;
use chrono::{DateTime, Utc};
use maud::{Markup, html};

const W: f64 = 300.0;
const H: f64 = 80.0;
const PAD: f64 = 4.0;

/// What a chart shows.
pub struct Chart<'a> {
    /// HTML id of the chart's figure.
    pub id: &'a str,
    pub title: &'a str,
    /// What a value counts (`rows`, `s`).
    pub unit: &'a str,
    pub series: &'a Series,
    /// The left edge of the time axis (the right edge is `now`).
    pub since: DateTime<Utc>,
    pub now: DateTime<Utc>,
    pub grafana: Option<String>,
}

impl Chart<'_> {
    /// The chart as a figure: title, SVG, latest and maximum values, Grafana link.
    pub fn draw(&self) -> Markup {
        let max = self.series.iter().map(|p| p.1).fold(0.0_f64, f64::max);
        let latest = self.series.last().map(|p| p.1);
        let span = (self.now - self.since).num_milliseconds().max(1) as f64;
        let x = |t: DateTime<Utc>| {
            PAD + (W - 2.0 * PAD)
                * ((t - self.since).num_milliseconds() as f64 / span).clamp(0.0, 1.0)
        };
        let y = |v: f64| H - PAD - (H - 2.0 * PAD) * if max > 0.0 { v / max } else { 0.0 };
        let points: Vec<String> = self
            .series
            .iter()
            .map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v)))
            .collect();
        html! {
            figure.chart id=(self.id) data-samples=(self.series.len()) {
                figcaption {
                    b { (self.title) } " · now "
                    span.latest { @match latest { Some(v) => { (fmt(v)) " " (self.unit) }, None => "–" } }
                    " · max " (fmt(max))
                    @if let Some(url) = &self.grafana { " · " a.grafana href=(url) { "Grafana" } }
                }
                svg xmlns="http://www.w3.org/2000/svg" width=(W) height=(H) viewBox={ "0 0 " (W) " " (H) } role="img" {
                    title { (self.title) " over the last hour: " (self.series.len()) " samples" }
                    rect x="0" y="0" width=(W) height=(H) fill="#fafafa" stroke="#ddd" {}
                    @if self.series.is_empty() {
                        text x=(W / 2.0) y=(H / 2.0) text-anchor="middle" font-size="12" fill="#777" { "no samples yet" }
                    } @else {
                        polyline points=(points.join(" ")) fill="none" stroke="#1e63b5" stroke-width="2" {}
                        @if let Some((t, v)) = self.series.last() {
                            circle cx=(x(*t)) cy=(y(*v)) r="3" fill="#1e63b5" {}
                        }
                    }
                    text x=(PAD) y=(H - PAD - 2.0) font-size="9" fill="#777" { "-1h" }
                    text x=(W - PAD) y=(H - PAD - 2.0) font-size="9" fill="#777" text-anchor="end" { "now" }
                }
            }
        }
    }
}

/// A value as shown: whole numbers without decimals.
fn fmt(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}
