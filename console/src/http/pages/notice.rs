//! The green notice box after an action: one of a fixed set of texts, named in the redirect's URL
//! by its code (`?notice=approval_requested`), with at most the approval request's id (a UUID).
//! Nothing else a URL carries reaches the page, so no link can put its own words in the console's
//! mouth.

use maud::{Markup, html};
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

/// What the notice box may say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// The action ran.
    Done,
    /// An approval request was created; an approver must confirm it.
    ApprovalRequested,
    /// An approval request was approved: its action ran.
    Approved,
    /// An approval request was rejected: nothing ran.
    Rejected,
}

impl Notice {
    const ALL: [Notice; 4] = [
        Notice::Done,
        Notice::ApprovalRequested,
        Notice::Approved,
        Notice::Rejected,
    ];

    /// Its code in a URL.
    fn code(self) -> &'static str {
        match self {
            Notice::Done => "done",
            Notice::ApprovalRequested => "approval_requested",
            Notice::Approved => "approved",
            Notice::Rejected => "rejected",
        }
    }

    fn parse(code: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|n| n.code() == code)
    }

    fn text(self) -> &'static str {
        match self {
            Notice::Done => "Done: the action ran.",
            Notice::ApprovalRequested => {
                "An approval request was created; an approver must confirm it."
            }
            Notice::Approved => "The approval request was approved: its action ran.",
            Notice::Rejected => "The approval request was rejected: nothing ran.",
        }
    }

    /// The notice for an action's JSON answer.
    pub fn of_answer(v: &Value) -> Self {
        match (
            v.get("approval").and_then(Value::as_str),
            v.get("status").and_then(Value::as_str),
        ) {
            (Some(_), Some("pending")) => Notice::ApprovalRequested,
            (Some(_), Some("approved")) => Notice::Approved,
            (Some(_), Some("rejected")) => Notice::Rejected,
            _ => Notice::Done,
        }
    }

    /// `path` with this notice (and the approval request it is about) in the query.
    pub fn url(self, path: &str, v: &Value) -> String {
        let code = self.code();
        match v
            .get("approval")
            .and_then(Value::as_str)
            .and_then(|a| a.parse::<Uuid>().ok())
        {
            Some(a) => format!("{path}?notice={code}&approval={a}"),
            None => format!("{path}?notice={code}"),
        }
    }
}

/// The query of a page that shows a notice. Both fields are read leniently: an unknown code or a
/// malformed id shows no notice (the page itself still answers).
#[derive(Debug, Default, Deserialize)]
pub struct NoticeQuery {
    notice: Option<String>,
    approval: Option<String>,
}

impl NoticeQuery {
    /// The notice box, or nothing.
    pub fn html(&self) -> Markup {
        let Some(n) = self.notice.as_deref().and_then(Notice::parse) else {
            return html! {};
        };
        let about = self
            .approval
            .as_deref()
            .and_then(|a| a.parse::<Uuid>().ok());
        html! {
            p.notice #notice {
                (n.text())
                @if let Some(a) = about { " (approval request " (a) ")" }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rendered notice, compared as text.
    struct Shown(String);

    impl Shown {
        fn html(&self) -> String {
            self.0.clone()
        }
    }

    #[test]
    fn only_the_fixed_texts_reach_the_page() {
        let q = |n: &str, a: &str| NoticeQuery {
            notice: Some(n.into()),
            approval: Some(a.into()),
        };
        let q = |n: &str, a: &str| Shown(q(n, a).html().into_string());
        assert_eq!(q("<script>alert(1)</script>", "").html(), "");
        assert_eq!(q("Your account is locked, call 555", "").html(), "");
        let id = Uuid::new_v4();
        let h = q("approval_requested", &id.to_string()).html();
        assert!(h.contains("approval request was created") && h.contains(&id.to_string()));
        assert!(!q("done", "<b>x</b>").html().contains("<b>"));
        let answer = serde_json::json!({"approval": id, "status": "pending"});
        assert_eq!(
            Notice::of_answer(&answer).url("/", &answer),
            format!("/?notice=approval_requested&approval={id}")
        );
    }
}
