//! The top of the overview: a dashboard a person can leave open. Tiles for what needs someone
//! (manual review with the age of the oldest, dead-letter depth per configured consumer, dead
//! outbox rows, the outbox backlog, approvals waiting for *me*), charts of the last hour from the
//! console's samples ([`crate::targets::samples`]), relative times, and a refresh toggle: a
//! link that adds `?refresh=N`, which puts `<meta http-equiv="refresh">` in the page (no script;
//! off by default).

use super::badge::badge;
use super::charts::Chart;
use super::layout::shown;
use super::links::{self, Links};
use crate::actions::{Action, allowed, approvals};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::samples;
use crate::text::url_encode;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use serde::Deserialize;

/// The refresh intervals offered, in seconds.
pub const REFRESH: [u32; 3] = [10, 30, 60];

/// The overview's `?refresh=` (any other value, or none: off).
#[derive(Debug, Default, Deserialize)]
pub struct RefreshQuery {
    refresh: Option<String>,
}

impl RefreshQuery {
    /// The refresh interval chosen, if it is one of [`REFRESH`].
    pub fn seconds(&self) -> Option<u32> {
        let n = self.refresh.as_deref()?.trim().parse::<u32>().ok()?;
        REFRESH.contains(&n).then_some(n)
    }
}

/// "3m 12s ago" (or "in ..." for a time ahead), to the second.
pub fn ago(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let secs = (now - t).num_seconds();
    let span = humantime::format_duration(std::time::Duration::from_secs(secs.unsigned_abs()));
    if secs >= 0 {
        format!("{span} ago")
    } else {
        format!("in {span}")
    }
}

/// The counts the dashboard's tiles show, read once per page: the rest of the overview shows the
/// same figures (the manual-review link, the outbox line), so they never disagree on one page.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    pub review: processes::look::ReviewBacklog,
    pub backlog: relay::store::Backlog,
}

impl Figures {
    pub async fn read(s: &AppState) -> Result<Figures, ConsoleError> {
        Ok(Figures {
            review: processes::look::review_backlog(&s.pool, &s.schema).await?,
            backlog: relay::store::backlog(&s.pool, &s.schema).await?,
        })
    }
}

/// The dashboard: toggle, tiles, charts.
pub async fn dashboard(
    s: &AppState,
    session: &Session,
    refresh: Option<u32>,
    figures: &Figures,
) -> Result<Markup, ConsoleError> {
    let now = Utc::now();
    let Figures { review, backlog } = *figures;
    let depths = samples::dlq_depths(s).await;
    let mine = approvals_for(s, session).await?;
    let links = Links::new(&s.settings.look);
    Ok(html! {
        p.refresh #refresh {
            "Auto-refresh: "
            @match refresh {
                None => { b #refresh-state { "off" } }
                Some(n) => { b #refresh-state { "every " (n) " s" } " · " a #refresh-off href="/" { "off" } }
            }
            @for n in REFRESH {
                @if Some(n) != refresh { " · " a id={ "refresh-" (n) } href={ "/?refresh=" (n) } { (n) " s" } }
            }
            " · as of " span #as-of { (now.format("%H:%M:%S")) " UTC" }
        }
        div.tiles #tiles {
            div.tile #tile-review .alert[review.count > 0] .calm[review.count == 0] {
                a href="/processes?status=manual_review" { "Manual review" }
                span.figure { (review.count) }
                @match review.oldest_since {
                    Some(t) => span #review-oldest title=(t.format("%Y-%m-%d %H:%M:%S UTC")) { "oldest since " (ago(t, now)) },
                    None => "none waiting",
                }
            }
            @for (c, depth) in &depths {
                div.tile.dlq-tile id={ "tile-dlq-" (shown(c)) } .alert[depth.is_some_and(|d| d > 0)] .calm[*depth == Some(0)] {
                    a href={ "/dead-letters?consumer=" (url_encode(c)) } { "Dead letters · " (shown(c)) }
                    span.figure { @match depth { Some(d) => (d), None => "?" } }
                    @if depth.is_none() { "queue did not answer" } @else { "in " (shown(c)) ".dlq" }
                }
            }
            div.tile #tile-dead .alert[backlog.dead > 0] .calm[backlog.dead == 0] {
                a href="#dead-rows" { "Dead outbox rows" }
                span.figure { (backlog.dead) }
                "never published"
            }
            div.tile #tile-backlog {
                "Outbox backlog"
                span.figure { (backlog.pending) }
                "oldest " (humantime::format_duration(std::time::Duration::from_secs(backlog.oldest_age.as_secs()))) " old"
            }
            (approvals_tile(session, &mine))
        }
        (charts(s, &links, now).await?)
    })
}

/// Pending requests the user may approve: an approver's role, and not their own request.
async fn approvals_for(
    s: &AppState,
    session: &Session,
) -> Result<Vec<approvals::Approval>, ConsoleError> {
    if !allowed(session.principal.role, Action::ApprovalApprove) {
        return Ok(Vec::new());
    }
    Ok(approvals::list(&s.pool, s, Some("pending"))
        .await?
        .into_iter()
        .filter(|a| a.status == "pending" && a.requested_by != session.principal.name)
        .collect())
}

fn approvals_tile(session: &Session, mine: &[approvals::Approval]) -> Markup {
    let may = allowed(session.principal.role, Action::ApprovalApprove);
    html! {
        div.tile #tile-approvals .alert[!mine.is_empty()] .calm[mine.is_empty()] {
            a href="#approvals" { "Waiting for me" }
            span.figure #approvals-for-me { (mine.len()) }
            @if !may { "your role does not approve" }
            @else if let Some(oldest) = mine.iter().map(|a| a.requested_at).min() {
                "oldest asked " (ago(oldest, Utc::now())) " " (badge("pending"))
            } @else { "nothing to decide" }
        }
    }
}

/// The last hour's charts from the samples.
async fn charts(s: &AppState, links: &Links, now: DateTime<Utc>) -> Result<Markup, ConsoleError> {
    let since = now - chrono::TimeDelta::hours(1);
    let names = [
        samples::OUTBOX_PENDING,
        samples::OUTBOX_OLDEST,
        samples::MANUAL_REVIEW,
        samples::DEAD_LETTERS,
        samples::OUTBOX_DEAD,
    ]
    .map(String::from);
    let data = samples::since(&s.pool, &s.schema, &names, since).await?;
    let empty = Vec::new();
    let get = |n: &str| data.get(n).unwrap_or(&empty);
    let chart = |id, title, unit, name: &str, panel| Chart {
        id,
        title,
        unit,
        series: get(name),
        since,
        now,
        grafana: links.grafana(panel),
    };
    Ok(html! {
        div.charts #charts {
            (chart("chart-backlog", "Outbox backlog", "rows", samples::OUTBOX_PENDING, links::OUTBOX_BACKLOG).draw())
            (chart("chart-oldest", "Oldest pending age", "s", samples::OUTBOX_OLDEST, links::OUTBOX_OLDEST).draw())
            (chart("chart-review", "Manual review", "processes", samples::MANUAL_REVIEW, links::MANUAL_REVIEW).draw())
            (chart("chart-dead-letters", "Dead letters", "messages", samples::DEAD_LETTERS, links::DEAD_LETTERS).draw())
            (chart("chart-dead-rows", "Dead outbox rows", "rows", samples::OUTBOX_DEAD, links::OUTBOX_DEAD).draw())
        }
    })
}
