//! Values printed for operators: a row or a delivery may hold anything, so what a CLI prints must
//! not be able to forge lines, columns or terminal state.

use std::borrow::Cow;

/// `s` with every control character (C0, DEL, C1), every Unicode bidirectional override and the
/// backslash escaped (`\n`, `\t`, `\r`, `\\`, `\u{1b}`, `\u{202e}`), so a value prints on one line,
/// as itself. Plain text is returned as is, without copying.
pub fn escape_control(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            c if needs_escape(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// `s` cut to at most `max` bytes on a character boundary (what a bounded text column takes).
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    s[..s.floor_char_boundary(max)].to_string()
}

fn needs_escape(c: char) -> bool {
    c == '\\'
        || c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_cuts_on_a_character_boundary() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        assert_eq!(truncate("aé", 2), "a", "é is two bytes: not cut in half");
    }

    #[test]
    fn escapes_what_could_forge_output() {
        assert!(matches!(escape_control("order.placed"), Cow::Borrowed(_)));
        assert_eq!(escape_control("a\nb"), "a\\nb");
        assert_eq!(escape_control("x\r\ty"), "x\\r\\ty");
        assert_eq!(escape_control("\u{1b}[2J"), "\\u{1b}[2J");
        assert_eq!(escape_control("a\\nb"), "a\\\\nb");
        assert_eq!(escape_control("\u{202e}gpj.exe"), "\\u{202e}gpj.exe");
        assert_eq!(escape_control("\u{85}"), "\\u{85}");
        assert_eq!(escape_control("héllo ✓"), "héllo ✓");
    }
}
