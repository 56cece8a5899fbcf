//! Page cursors: what a client sends back as `?after=` to get the next page of a list.
//!
//! A cursor is opaque to the client (a tag naming the list and the last item's key) and checked
//! when it comes back: a cursor of another list, or text that is none, is a 400 naming only the
//! fault, never a page from the start (that would show the same rows twice without saying so).

use crate::error::ConsoleError;
use serde::Serialize;
use uuid::Uuid;

/// A page of a list: its items, how many there are in all (`total`: the list's own count) and
/// the cursor of the next page, `None` on the last.
#[derive(Debug, Clone, Serialize)]
pub struct Page<T, Total = i64> {
    pub items: Vec<T>,
    pub total: Total,
    pub next: Option<String>,
}

/// Which list a cursor belongs to: its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum List {
    /// Processes, by id (newest first).
    Processes,
    /// The audit log, by entry id.
    Audit,
    /// Dead outbox rows, by position.
    Dead,
    /// A dead-letter queue, by position from its head.
    DeadLetters,
}

impl List {
    fn tag(self) -> &'static str {
        match self {
            List::Processes => "p",
            List::Audit => "a",
            List::Dead => "d",
            List::DeadLetters => "q",
        }
    }
}

/// The cursor of `list` after the item with key `key`.
pub fn encode(list: List, key: &str) -> String {
    format!("{}{key}", list.tag())
}

/// Cuts `rows`, read with one row more than `limit`, to the page, and returns the cursor of the
/// next page (after the page's last row, whose key is `seq_of` it), or `None` on the last page.
pub fn cut_page<T>(
    rows: &mut Vec<T>,
    limit: i64,
    list: List,
    seq_of: impl Fn(&T) -> i64,
) -> Option<String> {
    let more = rows.len() as i64 > limit;
    rows.truncate(usize::try_from(limit).unwrap_or(0));
    if more {
        rows.last().map(|r| encode(list, &seq_of(r).to_string()))
    } else {
        None
    }
}

/// The key in a cursor of `list`; anything else is a 400.
fn key(list: List, cursor: &str) -> Result<&str, ConsoleError> {
    cursor
        .strip_prefix(list.tag())
        .filter(|k| !k.is_empty() && k.len() <= 64)
        .ok_or_else(bad)
}

fn bad() -> ConsoleError {
    ConsoleError::BadRequest("after: not a cursor of this list (take it from `next`)".into())
}

/// A process cursor: the last id of the previous page.
pub fn process(cursor: &str) -> Result<Uuid, ConsoleError> {
    let k = key(List::Processes, cursor)?;
    // The simple form only (32 hex digits), as `encode` writes it.
    if k.len() != 32 {
        return Err(bad());
    }
    Uuid::try_parse(k).map_err(|_| bad())
}

/// The cursor after process `id`.
pub fn after_process(id: Uuid) -> String {
    encode(List::Processes, &id.simple().to_string())
}

/// A positional cursor of `list` (audit entry id, dead row position, dead-letter offset):
/// a non-negative number.
pub fn position(list: List, cursor: &str) -> Result<i64, ConsoleError> {
    let k = key(list, cursor)?;
    if !k.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    k.parse::<i64>().map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_comes_back_as_it_went_and_nothing_else_passes() {
        let id = Uuid::now_v7();
        assert_eq!(process(&after_process(id)).ok(), Some(id));
        assert_eq!(
            position(List::Audit, &encode(List::Audit, "42")).ok(),
            Some(42)
        );
        for bad in ["", "p", "x", &id.to_string(), "a42", "p' OR 1=1", "q-1"] {
            assert!(process(bad).is_err(), "{bad}");
        }
        for bad in ["", "p42", "a", "a-1", "a4x", "a99999999999999999999"] {
            assert!(position(List::Audit, bad).is_err(), "{bad}");
        }
    }
}
