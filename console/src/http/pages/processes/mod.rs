//! The process pages: the list ([`find`]: one search box, filters, counts by status, keyset pages,
//! [`bulk`] actions by filter) and one process ([`mod@page`]: the [`strip`] of its steps first,
//! overall and per-step status, the last classified error, attempts, operation ids,
//! external references, the [`timeline`] of transitions and operator actions, and the
//! [`actions`] allowed now that the user's role may ask for). Everything shown is redacted.

pub mod actions;
pub mod bulk;
pub mod find;
pub mod page;
pub mod strip;
pub mod timeline;
pub mod values;

pub use find::list_page;

use super::badge::badge;
use super::layout::shown;
use maud::{Markup, html};
use serde_json::{Value, json};
use values::{txt, when};

/// One process of the list.
pub(crate) fn row(p: &Value) -> Markup {
    let id = txt(p, "id");
    let status = txt(p, "status");
    html! {
        tr class={ "process status-" (status) } {
            td { a href={ "/processes/" (id) } id={ "process-" (id) } { code { (id) } } }
            td { (shown(&txt(p, "kind"))) " v" (shown(&txt(p, "definition_version"))) }
            td { (shown(&txt(p, "business_key"))) }
            td.status { (badge(&status)) @if p["paused"] == json!(true) { " " (badge("paused")) } }
            td { (shown(&txt(p, "attempt"))) }
            td { (when(p, "created_at")) }
            td { (when(p, "updated_at")) }
            td { (shown(&txt(p, "last_actor"))) ": " (shown(&txt(p, "last_reason"))) }
            td { (shown(&txt(p, "version"))) }
        }
    }
}

/// The status filter's options, `selected` chosen.
pub(crate) fn status_options(selected: Option<&str>) -> Markup {
    use processes::ProcessStatus as S;
    // Manual review first: what an operator looks for.
    const STATUSES: [S; 9] = [
        S::ManualReview,
        S::Pending,
        S::Running,
        S::Waiting,
        S::Compensating,
        S::Succeeded,
        S::Failed,
        S::Compensated,
        S::Cancelled,
    ];
    html! {
        option value="" { "any" }
        @for st in STATUSES { option selected[selected == Some(st.as_str())] { (st.as_str()) } }
    }
}
