//! The audit log page (filtered, newest first) and the audit table other pages show (recent
//! entries on the overview, a process's operator actions on its page).

use super::badge::badge;
use super::diff::{diff, target_link};
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
                    td.change { (diff(e.before.as_ref(), e.after.as_ref())) }
                }
            }
        }
    }
}

/// `GET /audit`: the filter form, how to export, and the entries.
pub async fn audit_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(f): Query<audit::Filter>,
) -> Response {
    if let Err(e) = f.check() {
        return error_page(Some(&session), &e);
    }
    let entries = match audit::list(&s.pool, &s.schema, &f, false).await {
        Ok(e) => e,
        Err(e) => return error_page(Some(&session), &e),
    };
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
    };
    page(Some(&session), "Audit log", body).into_response()
}
