//! The audit log page (filtered, newest first) and the audit table other pages show (recent
//! entries on the overview, a process's operator actions on its page).

use super::badge::badge;
use super::diff::{diff, fields, target_link};
use super::errors::error_page;
use super::layout::{page, shown};
use super::session::WebSession;
use crate::actions::audit;
use crate::state::AppState;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

/// Audit entries as a table with HTML id `id`.
pub fn audit_table(id: &str, entries: &[audit::Entry]) -> Markup {
    html! {
        table id=(id) {
            tr {
                th { "#" } th { "when" } th { "who" } th { "roles" } th { "action" } th { "target" }
                th { "reason" } th { "approver" } th { "outcome" } th { "before → after" }
            }
            @for e in entries {
                tr.audit-entry {
                    td { (e.seq) }
                    td { (e.at.format("%Y-%m-%d %H:%M:%S")) }
                    td { (shown(&e.actor_name)) }
                    td { (shown(&e.roles.join(","))) }
                    td { (shown(&e.action)) }
                    td { (target_link(&e.target)) }
                    td { (shown(&e.reason)) }
                    td { (shown(e.approver.as_deref().unwrap_or(""))) }
                    td.outcome { (badge(&e.outcome)) }
                    td.change { (change(e)) }
                }
            }
        }
    }
}

/// What an entry changed. A request waiting for approval changed nothing yet: its target as it
/// was asked on and the request are shown side by side, not as a diff (which read as if the
/// request had changed the process into the request; issue 40, bug 5).
fn change(e: &audit::Entry) -> Markup {
    if e.outcome != audit::outcome::REQUESTED {
        return diff(e.before.as_ref(), e.after.as_ref());
    }
    html! {
        p.request-note { "Nothing changed yet: a request waiting for approval." }
        @if let Some(after) = &e.after {
            details.request open { summary { "the request" } (fields(after)) }
        }
        @if let Some(before) = &e.before {
            details.request-target { summary { "the target when asked" } (fields(before)) }
        }
    }
}

/// `GET /audit`: the filter form, how to export, and the entries.
pub async fn audit_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(f): Query<audit::Filter>,
    Query(at): Query<super::paging::From>,
) -> Response {
    if let Err(e) = f.check() {
        return error_page(Some(&session), &e);
    }
    let found = async {
        let first = super::paging::first_row(at.from.as_deref())?;
        Ok::<_, crate::error::ConsoleError>((
            first,
            crate::actions::audit_page::page(&s.pool, &s.schema, &f).await?,
        ))
    };
    let (first, found) = match found.await {
        Ok(f) => f,
        Err(e) => return error_page(Some(&session), &e),
    };
    let entries = found.items;
    let base = audit_base(&f);
    let v = |o: &Option<String>| shown(o.as_deref().unwrap_or(""));
    let body = html! {
        form method="get" {
            "actor " input name="actor" value=(v(&f.actor));
            " action " input name="action" value=(v(&f.action));
            " outcome " input name="outcome" value=(v(&f.outcome));
            " target " input name="target" value=(v(&f.target));
            " " button { "Filter" }
        }
        p {
            "Export: " code { "GET /api/audit?format=jsonl" } " or " code { "console audit export" }
            ". Retention: " (s.settings.audit_retention_days) " days."
        }
        (audit_table("audit", &entries))
        (super::paging::footer(&base, first, entries.len(), found.total, found.next.as_deref()))
    };
    page(Some(&session), "Audit log", body).into_response()
}

/// The audit page's URL with the filters of `f` (the base of its Next link).
fn audit_base(f: &audit::Filter) -> String {
    let q: Vec<String> = [
        ("actor", &f.actor),
        ("action", &f.action),
        ("outcome", &f.outcome),
        ("target", &f.target),
    ]
    .iter()
    .filter_map(|(k, v)| v.as_deref().filter(|v| !v.is_empty()).map(|v| (k, v)))
    .map(|(k, v)| format!("{k}={}", crate::text::url_encode(v)))
    .chain(
        f.since
            .map(|s| format!("since={}", crate::text::url_encode(&s.to_rfc3339()))),
    )
    .collect();
    if q.is_empty() {
        "/audit".into()
    } else {
        format!("/audit?{}", q.join("&"))
    }
}
