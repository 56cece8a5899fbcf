//! What every long list shows under its table: "showing 51–100 of 2,536" and a "Next" link that
//! carries the cursor. A list is never cut silently: the line says how many there are in all.

use crate::error::ConsoleError;
use crate::text::url_encode;
use maud::{Markup, html};

/// The row number a "Next" link carries (`?from=`), for pages whose own query type has no place
/// for it.
#[derive(Debug, Default, serde::Deserialize)]
pub struct From {
    pub from: Option<String>,
}

/// `n` with thousands separators: 2,536.
pub fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// The position of a page's first row, as the previous page's "Next" link says it (`from`); it
/// only numbers the rows shown, the cursor decides which they are. Not a number: a 400.
pub fn first_row(from: Option<&str>) -> Result<i64, ConsoleError> {
    match from.map(str::trim).filter(|f| !f.is_empty()) {
        None => Ok(1),
        Some(f) => f
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| ConsoleError::BadRequest("from: a row number from 1".into())),
    }
}

/// The line under a list: which rows are shown of how many, and the link to the next page
/// (`base` is the list's URL with its filters, `next` the cursor, `shown` the rows on this page).
pub fn footer(base: &str, first: i64, shown: usize, total: i64, next: Option<&str>) -> Markup {
    let last = first + shown as i64 - 1;
    let sep = if base.contains('?') { "&" } else { "?" };
    html! {
        p.paging #paging {
            @if shown == 0 {
                "showing none of " (thousands(total))
            } @else {
                "showing " span #first-row { (thousands(first)) } "–" span #last-row { (thousands(last)) }
                " of " span #total { (thousands(total)) }
            }
            @if let Some(n) = next {
                " "
                a #next href={ (base) (sep) "after=" (url_encode(n)) "&from=" (last + 1) } { "Next" }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_separated() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(2536), "2,536");
        assert_eq!(thousands(1_000_000), "1,000,000");
    }

    #[test]
    fn a_row_number_is_a_number_from_one() {
        assert_eq!(first_row(None).ok(), Some(1));
        assert_eq!(first_row(Some("51")).ok(), Some(51));
        assert!(first_row(Some("0")).is_err() && first_row(Some("x")).is_err());
    }
}
