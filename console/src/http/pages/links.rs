//! Where a page's names link to: the console's own pages (an aggregate's outbox messages, a
//! process), and, when configured, the trace viewer (`CONSOLE_TRACE_URL`), the remote's page of
//! a reference (`CONSOLE_REMOTE_URL`) and Grafana's panels (`CONSOLE_GRAFANA_URL`). A template
//! that is not an `http(s)` URL is ignored, so no setting can put a `javascript:` link on a page.

use crate::config::LookConfig;
use crate::text::url_encode;

/// A Grafana panel of the provisioned dashboards (`deploy/grafana/dashboards`): uid and panel id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Panel {
    pub dashboard: &'static str,
    pub id: u32,
}

impl Panel {
    /// Panel `id` of the flow overview (`outbox-overview`).
    const fn overview(id: u32) -> Self {
        Self {
            dashboard: "outbox-overview",
            id,
        }
    }
}

/// "Waiting events" of the flow overview (the outbox backlog over time).
pub const OUTBOX_BACKLOG: Panel = Panel::overview(12);
/// "Oldest pending outbox row" of the flow overview.
pub const OUTBOX_OLDEST: Panel = Panel::overview(13);
/// "Dead outbox rows" of the flow overview.
pub const OUTBOX_DEAD: Panel = Panel::overview(16);
/// "Dead-letter queues" of the flow overview.
pub const DEAD_LETTERS: Panel = Panel::overview(17);
/// "Manual review backlog" of the processes dashboard.
pub const MANUAL_REVIEW: Panel = Panel {
    dashboard: "processes",
    id: 20,
};

/// The configured link targets.
#[derive(Debug, Clone, Default)]
pub struct Links {
    grafana: Option<String>,
    trace: Option<String>,
    remote: Option<String>,
}

/// `url` if it is an http(s) URL.
fn web_url(url: &Option<String>) -> Option<String> {
    url.as_ref()
        .map(|u| u.trim().to_string())
        .filter(|u| u.starts_with("https://") || u.starts_with("http://"))
}

impl Links {
    pub fn new(look: &LookConfig) -> Self {
        Self {
            grafana: web_url(&look.grafana_url).map(|u| u.trim_end_matches('/').to_string()),
            trace: web_url(&look.trace_url).filter(|u| u.contains("{trace_id}")),
            remote: web_url(&look.remote_url).filter(|u| u.contains("{ref}")),
        }
    }

    /// The page listing the outbox messages of aggregate `id`.
    pub fn messages(id: &str) -> String {
        format!("/messages?aggregate_id={}", url_encode(id))
    }

    /// The trace of a W3C `traceparent`, when a trace viewer is configured and it is valid.
    pub fn trace(&self, traceparent: &str) -> Option<(String, String)> {
        let id = shared::trace::trace_id(Some(traceparent))?;
        let url = self.trace.as_ref()?.replace("{trace_id}", &url_encode(id));
        Some((id.to_string(), url))
    }

    /// The remote's page of reference `r`, when configured.
    pub fn remote(&self, r: &str) -> Option<String> {
        let r = r.trim();
        if r.is_empty() {
            return None;
        }
        Some(self.remote.as_ref()?.replace("{ref}", &url_encode(r)))
    }

    /// A Grafana panel over the last hour, when Grafana is configured.
    pub fn grafana(&self, p: Panel) -> Option<String> {
        let base = self.grafana.as_ref()?;
        Some(format!(
            "{base}/d/{}?viewPanel={}&from=now-1h&to=now",
            p.dashboard, p.id
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_fill_in_and_only_web_urls_count() {
        let l = Links::new(&LookConfig {
            grafana_url: Some("https://g.example/".into()),
            trace_url: Some("https://t.example/trace/{trace_id}".into()),
            remote_url: Some("javascript:alert({ref})".into()),
            sample_interval_ms: 1000,
        });
        assert_eq!(
            l.trace("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
                .map(|t| t.1),
            Some("https://t.example/trace/4bf92f3577b34da6a3ce929d0e0e4736".into())
        );
        assert_eq!(l.trace("not a traceparent"), None);
        assert_eq!(l.remote("ch_1"), None, "a javascript: template is ignored");
        assert_eq!(
            l.grafana(MANUAL_REVIEW).as_deref(),
            Some("https://g.example/d/processes?viewPanel=20&from=now-1h&to=now")
        );
        assert_eq!(Links::messages("a b"), "/messages?aggregate_id=a%20b");
    }
}
