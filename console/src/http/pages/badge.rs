//! Status badges: a status as its word on a coloured ground, so `failed` and `succeeded` never
//! look alike, and a person who does not see the colour still reads the word (the colour is
//! extra, never the only sign). One palette for processes, steps, approvals, outbox rows and dead
//! letters, shared with the step strip ([`colour`]).

use super::layout::shown;
use maud::{Markup, html};

/// What a status means to a person: each tone has one colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tone {
    /// Done as intended: succeeded, published, approved.
    Good,
    /// Ended badly: failed, dead, rejected.
    Bad,
    /// A person must look: manual_review, retryable, pending approval.
    Attention,
    /// Under way: running, pending, waiting.
    Busy,
    /// Undone on purpose: compensating, compensated.
    Undone,
    /// Over without effect: cancelled, superseded, skipped.
    Quiet,
}

impl Tone {
    /// The tone of a status word (processes, steps, approvals, outbox rows); unknown words are
    /// quiet.
    pub fn of(status: &str) -> Self {
        match status {
            "succeeded" | "published" | "approved" | "ok" | "done" => Tone::Good,
            "failed" | "dead" | "rejected" | "denied" | "error" => Tone::Bad,
            "manual_review" | "retryable" | "unknown" | "paused" => Tone::Attention,
            "pending" | "running" | "waiting" => Tone::Busy,
            "compensating" | "compensated" => Tone::Undone,
            _ => Tone::Quiet,
        }
    }

    /// The CSS class (`badge-good`, ...).
    pub fn class(self) -> &'static str {
        match self {
            Tone::Good => "badge-good",
            Tone::Bad => "badge-bad",
            Tone::Attention => "badge-attention",
            Tone::Busy => "badge-busy",
            Tone::Undone => "badge-undone",
            Tone::Quiet => "badge-quiet",
        }
    }
}

/// The fill colour of a status (the step strip's boxes; the badges use the same colours).
pub fn colour(status: &str) -> &'static str {
    match Tone::of(status) {
        Tone::Good => "#2e7d32",
        Tone::Bad => "#c62828",
        Tone::Attention => "#ef8f00",
        Tone::Busy => "#1e63b5",
        Tone::Undone => "#7b3fa0",
        Tone::Quiet => "#757575",
    }
}

/// A status as a badge: the word itself, coloured by its tone; `status` is also a class
/// (`status-failed`) tests and stylesheets may select.
pub fn badge(status: &str) -> Markup {
    let word = shown(status);
    let slug: String = word
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    html! {
        span class={ "badge " (Tone::of(status).class()) " status-" (slug) } { (word) }
    }
}

/// The badges' rules, appended to the console's stylesheet (white text on each colour: every
/// pair has a contrast ratio of at least 4.5:1).
pub const STYLE: &str = ".badge{display:inline-block;padding:0 .45em;border-radius:.6em;color:#fff;font-weight:bold;font-size:.85em;line-height:1.5}\
.badge-good{background:#2e7d32}.badge-bad{background:#c62828}.badge-attention{background:#a85f00}\
.badge-busy{background:#1e63b5}.badge-undone{background:#7b3fa0}.badge-quiet{background:#616161}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_and_succeeded_never_share_a_colour_and_keep_their_word() {
        assert_ne!(colour("failed"), colour("succeeded"));
        assert_ne!(Tone::of("failed"), Tone::of("succeeded"));
        let b = badge("failed").into_string();
        assert!(b.contains(">failed<") && b.contains("badge-bad"), "{b}");
        let hostile = badge("<x y=\"z\">").into_string();
        assert!(!hostile.contains("<x"), "{hostile}");
    }
}
