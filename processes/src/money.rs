//! Which input fields are money, so every place that shows a process shows its amounts in the
//! currency's major units ("63.96 EUR"), never its minor units as if they were major ("6396
//! EUR"; issue 40). A definition declares each amount (a path in the input holding whole minor
//! units) and where its currency comes from (another input field, or a fixed ISO 4217 code).
//! At start, the declared amounts are resolved against the input and stored beside it
//! (`processes.money`), so the console and the CLI need no definition to show them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where an amount's currency comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CurrencyOf {
    /// An input field (top-level or a dotted path) holding the ISO 4217 code.
    Field(String),
    /// Always this ISO 4217 code.
    Code(String),
}

/// One declared amount: an input path holding whole minor units, and its currency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoneyField {
    pub amount: String,
    pub currency: CurrencyOf,
}

/// One amount of a process as stored in `processes.money` and shown: the field it came from,
/// the minor units and currency as given, and how a person reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Amount {
    /// The input path the amount was declared at (`amount`, `refund.minor`).
    pub field: String,
    /// The stored figure, when it is a whole number of minor units.
    pub minor: Option<i64>,
    /// The currency code as the input gave it (empty when it gave none).
    pub currency: String,
    /// What a person reads: "63.96 EUR", "500 JPY"; or why it cannot be shown in major units
    /// ("6396 minor units of XYZ", "1.5 as stored: not a whole number of minor units").
    pub shown: String,
}

fn at<'v>(input: &'v Value, path: &str) -> Option<&'v Value> {
    path.split('.').try_fold(input, |v, part| v.get(part))
}

/// The declared amounts of `input`, in declaration order; a declared amount the input lacks
/// (or holds as null) is left out, since there is nothing to show.
pub fn resolve(input: &Value, declared: &[MoneyField]) -> Vec<Amount> {
    declared
        .iter()
        .filter_map(|m| {
            let value = at(input, &m.amount).filter(|v| !v.is_null())?;
            let currency = match &m.currency {
                CurrencyOf::Code(code) => code.clone(),
                CurrencyOf::Field(path) => at(input, path)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .trim()
                    .to_string(),
            };
            Some(amount(&m.amount, value, currency))
        })
        .collect()
}

/// How `value` at `field` in `currency` is shown.
pub fn amount(field: &str, value: &Value, currency: String) -> Amount {
    let minor = value.as_i64();
    let shown = match minor {
        Some(minor) => shared::money::format_minor(minor, &currency),
        None => {
            let code = if currency.is_empty() { "" } else { &currency };
            format!("{value} {code} as stored: not a whole number of minor units")
                .replace("  ", " ")
        }
    };
    Amount {
        field: field.to_string(),
        minor,
        currency,
        shown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn field(amount: &str, currency: &str) -> MoneyField {
        MoneyField {
            amount: amount.into(),
            currency: CurrencyOf::Field(currency.into()),
        }
    }

    #[test]
    fn declared_amounts_are_read_in_their_currencys_major_units() {
        let input = json!({"amount": 6396, "currency": "EUR", "refund": {"minor": 12405}});
        let declared = [
            field("amount", "currency"),
            field("refund.minor", "currency"),
        ];
        let shown: Vec<String> = resolve(&input, &declared)
            .into_iter()
            .map(|a| a.shown)
            .collect();
        assert_eq!(shown, ["63.96 EUR", "124.05 EUR"]);
    }

    #[test]
    fn a_fixed_code_and_a_currency_without_minor_units() {
        let declared = [MoneyField {
            amount: "price".into(),
            currency: CurrencyOf::Code("JPY".into()),
        }];
        let a = resolve(&json!({"price": 500}), &declared);
        assert_eq!(a[0].shown, "500 JPY");
        assert_eq!(a[0].minor, Some(500));
    }

    #[test]
    fn what_cannot_be_read_as_money_is_shown_as_stored_and_says_so() {
        let declared = [field("amount", "currency")];
        let a = resolve(&json!({"amount": 1.5, "currency": "EUR"}), &declared);
        assert_eq!(
            a[0].shown,
            "1.5 EUR as stored: not a whole number of minor units"
        );
        assert_eq!(a[0].minor, None);
        let a = resolve(&json!({"amount": 6396, "currency": "XYZ"}), &declared);
        assert_eq!(a[0].shown, "6396 minor units of XYZ");
        let a = resolve(&json!({"amount": 6396}), &declared);
        assert_eq!(a[0].shown, "6396 minor units of an unnamed currency");
        assert!(resolve(&json!({"currency": "EUR"}), &declared).is_empty());
        assert!(resolve(&json!({"amount": null}), &declared).is_empty());
    }
}
