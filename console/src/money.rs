//! A process's amounts as a person reads them, the same on the approval card, the process page
//! and in the CLI: "63.96 EUR", never the minor units as if they were major ("6396 EUR"; issue
//! 40). The definition declares which input fields are money (`Definition::money`) and the start
//! stores them resolved (`processes.money`); a process whose definition declares none falls back
//! to the product's convention, `amount` in minor units with `currency`, and says so.

use processes::money::{Amount, amount};
use serde_json::Value;

/// One amount to show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    /// The input field it came from.
    pub field: String,
    /// "63.96 EUR", or why it cannot be read in major units.
    pub shown: String,
    /// The stored figure, when it is a whole number of minor units.
    pub minor: Option<i64>,
    /// false when read by the convention (`amount`, `currency`) because the definition declares
    /// no money.
    pub declared: bool,
}

impl Shown {
    fn from(a: Amount, declared: bool) -> Self {
        Self {
            field: a.field,
            shown: a.shown,
            minor: a.minor,
            declared,
        }
    }

    /// One line for text output: "amount 63.96 EUR (6396 minor units)".
    pub fn line(&self) -> String {
        let mut s = format!("{} {}", self.field, self.shown);
        if let Some(minor) = self.minor {
            s.push_str(&format!(" ({minor} minor units)"));
        }
        if !self.declared {
            s.push_str(" [by convention: the definition declares no money]");
        }
        s
    }
}

/// The amounts of a process as the API shows it (`money` and `input`; a card's process too).
pub fn of_process(p: &Value) -> Vec<Shown> {
    let declared: Vec<Amount> = p["money"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| serde_json::from_value(a.clone()).ok())
        .collect();
    if !declared.is_empty() {
        return declared.into_iter().map(|a| Shown::from(a, true)).collect();
    }
    let input = &p["input"];
    match input.get("amount").filter(|v| !v.is_null()) {
        Some(v) => {
            let currency = input["currency"].as_str().unwrap_or("").trim().to_string();
            vec![Shown::from(amount("amount", v, currency), false)]
        }
        None => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn declared_amounts_come_first_and_the_convention_only_without_them() {
        let p = json!({
            "input": {"amount": 6396, "currency": "EUR", "fee": 500},
            "money": [{"field": "fee", "minor": 500, "currency": "JPY", "shown": "500 JPY"}]
        });
        let shown = of_process(&p);
        assert_eq!(shown.len(), 1);
        assert_eq!(shown[0].line(), "fee 500 JPY (500 minor units)");
        let p = json!({"input": {"amount": 12405, "currency": "EUR"}, "money": []});
        assert_eq!(
            of_process(&p)[0].line(),
            "amount 124.05 EUR (12405 minor units) [by convention: the definition declares no money]"
        );
        assert!(of_process(&json!({"input": {"n": 1}})).is_empty());
    }
}
