//! The overview: the [`super::dashboard`] (tiles, charts, refresh toggle), processes in manual review, the outbox backlog, dead outbox rows with the
//! requeue form (and its dry run), approval requests and the recent audit entries.

use super::approvals::approvals_table;
use super::audit::audit_table;
use super::dashboard::{Figures, RefreshQuery, dashboard};
use super::errors::error_page;
use super::forms::{Fields, answered, csrf, field, hidden, submit};
use super::layout::{page, page_refreshing, shown};
use super::notice::NoticeQuery;
use super::session::WebSession;
use crate::actions::{Action, allowed, approvals, audit};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::{outbox_dead, outbox_dead_page};
use axum::Form;
use axum::extract::{Query, State};
use axum::response::{Html, IntoResponse, Response};
use maud::{Markup, html};
use serde_json::{Value, json};

/// Where the overview's list of dead rows is: `after` the cursor of its "Next" link, `from` the
/// number of the page's first row.
#[derive(Debug, Default, serde::Deserialize)]
pub struct DeadRowsQuery {
    after: Option<String>,
    from: Option<String>,
}

/// Dead rows the overview shows on one page.
const DEAD_ROWS_PER_PAGE: i64 = 200;

/// `GET /`.
pub async fn overview(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(n): Query<NoticeQuery>,
    Query(r): Query<RefreshQuery>,
    Query(d): Query<DeadRowsQuery>,
) -> Response {
    match render_overview(&s, &session, &n, r.seconds(), &d).await {
        Ok(h) => h.into_response(),
        Err(e) => error_page(Some(&session), &e),
    }
}

async fn render_overview(
    s: &AppState,
    session: &Session,
    notice: &NoticeQuery,
    refresh: Option<u32>,
    where_: &DeadRowsQuery,
) -> Result<Html<String>, ConsoleError> {
    let first = super::paging::first_row(where_.from.as_deref())?;
    let dead = outbox_dead_page::page(
        &s.pool,
        &s.schema,
        where_.after.as_deref(),
        Some(DEAD_ROWS_PER_PAGE),
    )
    .await?;
    let figures = Figures::read(s).await?;
    let dashboard = dashboard(s, session, refresh, &figures).await?;
    let backlog = figures.backlog;
    let pending = approvals::list(&s.pool, s, None).await?;
    let recent = audit::list(
        &s.pool,
        &s.schema,
        &audit::Filter {
            limit: Some(30),
            ..Default::default()
        },
        false,
    )
    .await?;
    let in_review = figures.review.count;
    let deps = crate::targets::dependencies::list(&s.pool, &s.schema).await?;
    let body = html! {
        (notice.html())
        (super::dependencies::down_lines(&deps))
        (dashboard)
        h2 { "Processes" }
        p #manual-review {
            a href="/processes?status=manual_review" { (in_review) " in manual review" }
            " · "
            a href="/processes" { "all processes" }
        }
        h2 { "Dependencies" }
        (super::dependencies::table(session, &deps))
        h2 { "Outbox" }
        p #backlog {
            "pending " b { (backlog.pending) } " (oldest " (backlog.oldest_age.as_secs())
            " s) · dead " b #dead-count { (backlog.dead) }
        }
        h2 { "Dead outbox rows" }
        (dead_rows(session, &dead, first))
        h2 { "Approval requests" }
        (approvals_table(session, &pending, None))
        h2 { "Recent audit entries" }
        (audit_table("audit", &recent))
    };
    Ok(page_refreshing(
        Some(session),
        "Operations console",
        body,
        refresh,
    ))
}

/// A page of dead rows (`first` is the number of its first row), in the requeue form when the
/// user's role may requeue, with "all that match" besides the ticked rows.
fn dead_rows(session: &Session, page: &outbox_dead_page::DeadPage, first: i64) -> Markup {
    let may_requeue = allowed(session.principal.role, Action::OutboxRequeue);
    let (dead, total) = (&page.items, page.total);
    // Never a silent cut: which rows of how many, and the next page.
    let shown_of = html! {
        div #dead-paging { (super::paging::footer("/", first, dead.len(), total, page.next.as_deref())) }
    };
    let table = html! {
        table #dead-rows {
            tr {
                th {} th { "id" } th { "event" } th { "aggregate" } th { "attempts" }
                th { "last error" } th { "version" }
            }
            @for r in dead {
                tr.dead-row {
                    td {
                        @if may_requeue && r.unpublishable.is_none() {
                            input type="checkbox" name="item" id={ "item-" (r.id) }
                                value={ (r.id) ":" (r.version) };
                        } @else if let Some(u) = &r.unpublishable {
                            "stays dead: " (shown(u))
                        }
                    }
                    td { a.dead-row-link href={ "/outbox/dead/" (r.id) } { (r.id) } }
                    td { (shown(&r.event_type)) }
                    td {
                        (shown(&r.aggregate_type)) "/"
                        a.aggregate href=(super::links::Links::messages(&r.aggregate_id)) { (shown(&r.aggregate_id)) }
                    }
                    td { (r.attempts) }
                    td { (shown(r.last_error.as_deref().unwrap_or(""))) }
                    td { (r.version) }
                }
            }
        }
    };
    if !may_requeue {
        return html! { (table) (shown_of) };
    }
    html! {
        form method="post" action="/ui/outbox/requeue" id="requeue-form" {
            (hidden(session))
            (table)
            (shown_of)
            @if total > 0 {
                p {
                    label {
                        input type="checkbox" name="all" value="1" id="requeue-all";
                        " all " (super::paging::thousands(total)) " dead rows, not only the ticked ones (frozen with their versions when you ask)"
                    }
                }
            }
            label { "Reason " input type="text" name="reason" id="requeue-reason" required; }
            " " button name="dry_run" value="1" id="requeue-dry-run" { "Dry run" }
            " " button name="go" value="1" id="requeue-submit" { "Requeue selected" }
            " " small { "one row runs now; more than one asks an approver" }
        }
    }
}

/// `POST /ui/outbox/requeue`: the checked rows (`item` = `ID:VERSION`), or their dry run.
pub async fn requeue(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Form(f): Form<Fields>,
) -> Response {
    if let Err(r) = csrf(&s, &session, &f, Action::OutboxRequeue.name()).await {
        return r;
    }
    let mut items = Vec::new();
    for (_, v) in f.iter().filter(|(k, _)| k == "item") {
        let parsed = v.split_once(':').and_then(|(id, ver)| {
            Some(outbox_dead::Item {
                id: id.parse().ok()?,
                version: ver.parse().ok()?,
            })
        });
        match parsed {
            Some(i) => items.push(i),
            None => {
                return error_page(
                    Some(&session),
                    &ConsoleError::BadRequest(format!("bad item {v:?}")),
                );
            }
        }
    }
    submit_selection(
        &s,
        &session,
        &f,
        ("/ui/outbox/requeue", "/api/outbox/dead/actions/requeue"),
        items,
    )
    .await
}

/// Sends a selection form's action to the API route `path`: the checked `items`, or `all` ("select
/// all that match"), with the form's reason. A dry run's answer is its plan ([`plan_page`]), a
/// done action returns to the overview.
pub async fn submit_selection<T: serde::Serialize>(
    state: &AppState,
    session: &Session,
    f: &Fields,
    (action, path): (&str, &str),
    items: Vec<T>,
) -> Response {
    let dry_run = field(f, "dry_run").is_some();
    let all = field(f, "all").is_some();
    let body = json!({
        "reason": field(f, "reason").unwrap_or(""),
        "items": if all { Vec::new() } else { items },
        "all": all,
        "dry_run": dry_run,
    });
    match submit(state, session, f, path, body).await {
        (status, v) if status.is_success() && dry_run => plan_page(session, action, f, &v),
        answer => answered(session, "/", answer),
    }
}

/// A dry run's answer: what each item would do, and a form that runs the same selection (`action`
/// is the form's URL; the checked items with the versions the operator saw, or "all that match",
/// and the reason, all editable no more), with a fresh Idempotency-Key. An item that changed
/// since is refused as stale when it runs, as from the list.
pub fn plan_page(session: &Session, action: &str, f: &Fields, v: &Value) -> Response {
    let items = v
        .get("items")
        .and_then(|i| i.as_array())
        .into_iter()
        .flatten();
    let text = |i: &Value, k: &str| shown(i.get(k).and_then(|w| w.as_str()).unwrap_or(""));
    let body = html! {
        table #plan {
            tr { th { "item" } th { "would" } th { "detail" } }
            @for i in items {
                @let id = i.get("id").or_else(|| i.get("message_id")).map(|x| x.to_string()).unwrap_or_default();
                tr {
                    td { (shown(id.trim_matches('"'))) }
                    td { (text(i, "would")) }
                    td { (text(i, "detail")) }
                }
            }
        }
        @if v.get("needs_approval").and_then(|b| b.as_bool()) == Some(true) {
            p { "More than one item: running it creates an approval request." }
        }
        form method="post" action=(action) id="run-plan" {
            (hidden(session))
            @for (_, item) in f.iter().filter(|(k, _)| k == "item") {
                input type="hidden" name="item" value=(shown(item));
            }
            @if field(f, "all").is_some() { input type="hidden" name="all" value="1"; }
            " reason " input name="reason" id="run-plan-reason" size="30" required
                value=(shown(field(f, "reason").unwrap_or("")));
            " " button name="go" value="1" id="run-plan-submit" { "Run this plan" }
        }
        p { a href="/" { "Overview" } }
    };
    page(Some(session), "Dry run", body).into_response()
}
