//! Report lines.

use serde::Serialize;

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Line {
    pub scenario: String,
    pub value: f64,
    pub unit: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub met: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Line {
    pub fn new(scenario: &str, value: f64, unit: &str) -> Self {
        Self {
            scenario: scenario.into(),
            value,
            unit: unit.into(),
            ceiling: None,
            ratio: None,
            target: None,
            met: None,
            note: None,
        }
    }
    /// Value as a fraction of a ceiling, with a minimum ratio as target.
    pub fn vs_ceiling(mut self, ceiling: f64, min_ratio: Option<f64>) -> Self {
        self.ceiling = Some(ceiling);
        let ratio = if ceiling > 0.0 {
            self.value / ceiling
        } else {
            0.0
        };
        self.ratio = Some(ratio);
        if let Some(min) = min_ratio {
            self.target = Some(format!(">= {:.0}% of ceiling", min * 100.0));
            self.met = Some(ratio >= min);
        }
        self
    }
    pub fn at_most(mut self, max: f64) -> Self {
        self.target = Some(format!("<= {max} {}", self.unit));
        self.met = Some(self.value <= max);
        self
    }
    pub fn at_least(mut self, min: f64) -> Self {
        self.target = Some(format!(">= {min} {}", self.unit));
        self.met = Some(self.value >= min);
        self
    }
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
    pub fn failed(scenario: &str, error: &str) -> Self {
        Self::new(scenario, f64::NAN, "error").note(error.to_string())
    }
}

pub fn print_table(lines: &[Line]) {
    println!(
        "| {:<34} | {:>12} | {:<8} | {:>12} | {:>7} | {:<22} | {:<4} |",
        "scenario", "value", "unit", "ceiling", "ratio", "target", "met"
    );
    println!(
        "|{:-<36}|{:->14}|{:-<10}|{:->14}|{:->9}|{:-<24}|{:-<6}|",
        "", "", "", "", "", "", ""
    );
    for l in lines {
        println!(
            "| {:<34} | {:>12} | {:<8} | {:>12} | {:>7} | {:<22} | {:<4} |",
            l.scenario,
            fmt_num(l.value),
            l.unit,
            l.ceiling.map(fmt_num).unwrap_or_default(),
            l.ratio
                .map(|r| format!("{:.0}%", r * 100.0))
                .unwrap_or_default(),
            l.target.clone().unwrap_or_default(),
            l.met.map(|m| if m { "yes" } else { "NO" }).unwrap_or(""),
        );
    }
    for l in lines.iter().filter(|l| l.note.is_some()) {
        println!("  {}: {}", l.scenario, l.note.as_deref().unwrap_or(""));
    }
}

fn fmt_num(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}
