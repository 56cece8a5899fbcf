//! Money as people read it: an amount in a currency's minor units (cents; how the product and the
//! example store every amount) shown in major units by the currency's ISO 4217 exponent, so
//! 6396 EUR cents read "63.96 EUR", 500 JPY (no minor unit) "500 JPY" and 1250 BHD fils
//! "1.250 BHD". A code ISO does not know, or one without a decimal exponent (XAU), is never
//! guessed: the amount is shown as minor units and says so.

use iso_currency::Currency;

/// The ISO 4217 exponent of `code` (EUR 2, JPY 0, BHD 3), if ISO gives it one.
pub fn exponent(code: &str) -> Option<u32> {
    Currency::from_code(code.trim())
        .and_then(|c| c.exponent())
        .map(u32::from)
}

/// `minor` units of `currency` in its major units with the code: "63.96 EUR", "-1.05 USD",
/// "500 JPY"; for a currency without a known exponent, "6396 minor units of XYZ".
pub fn format_minor(minor: i64, currency: &str) -> String {
    let code = currency.trim();
    let Some(exp) = exponent(code) else {
        let code = if code.is_empty() {
            "an unnamed currency"
        } else {
            code
        };
        return format!("{minor} minor units of {code}");
    };
    if exp == 0 {
        return format!("{minor} {code}");
    }
    let sign = if minor < 0 { "-" } else { "" };
    let abs = minor.unsigned_abs();
    let unit = 10u64.pow(exp);
    format!(
        "{sign}{}.{:0width$} {code}",
        abs / unit,
        abs % unit,
        width = exp as usize
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_are_shown_in_major_units_by_the_currencys_exponent() {
        assert_eq!(format_minor(6396, "EUR"), "63.96 EUR");
        assert_eq!(format_minor(12405, "EUR"), "124.05 EUR");
        assert_eq!(format_minor(5, "EUR"), "0.05 EUR");
        assert_eq!(format_minor(-105, "USD"), "-1.05 USD");
        assert_eq!(format_minor(500, "JPY"), "500 JPY");
        assert_eq!(format_minor(1250, "BHD"), "1.250 BHD");
        assert_eq!(format_minor(i64::MIN, "EUR"), "-92233720368547758.08 EUR");
    }

    #[test]
    fn an_unknown_currency_is_never_guessed() {
        assert_eq!(format_minor(6396, "XYZ"), "6396 minor units of XYZ");
        assert_eq!(format_minor(1, "XAU"), "1 minor units of XAU");
        assert_eq!(format_minor(7, ""), "7 minor units of an unnamed currency");
    }
}
