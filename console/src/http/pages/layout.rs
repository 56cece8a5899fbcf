//! The frame of every page (title, navigation with the user and a log-out form) and the
//! stylesheet it links. Templates are maud's: every value is escaped unless wrapped in
//! `PreEscaped`, so no page escapes by hand.

use crate::auth::sessions::Session;
use crate::redact;
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};

/// Text from a row, a message or a request as a page shows it: redacted (card numbers, tokens);
/// maud escapes it where it is placed.
pub fn shown(text: &str) -> String {
    redact::text(text)
}

/// A whole page: `body` under the navigation (for a signed-in `session`) and the title.
pub fn page(session: Option<&Session>, title: &str, body: Markup) -> Html<String> {
    page_refreshing(session, title, body, None)
}

/// [`page`], reloaded by the browser every `refresh` seconds when set (`<meta http-equiv>`: no
/// script needed).
pub fn page_refreshing(
    session: Option<&Session>,
    title: &str,
    body: Markup,
    refresh: Option<u32>,
) -> Html<String> {
    let title = shown(title);
    Html(
        html! {
            (DOCTYPE)
            html {
                head {
                    meta charset="utf-8";
                    @if let Some(n) = refresh { meta http-equiv="refresh" content=(n); }
                    title { (title) " · outbox console" }
                    link rel="stylesheet" href="/style.css";
                }
                body {
                    @if let Some(s) = session {
                        a.skip #skip href="#main" { "Skip to content" }
                        (nav(s))
                    }
                    main #main tabindex="-1" {
                        h1 { (title) }
                        (body)
                    }
                }
            }
        }
        .into_string(),
    )
}

/// The navigation: every page, who is signed in, and the log-out form.
fn nav(s: &Session) -> Markup {
    html! {
        nav {
            a href="/" { "Overview" }
            a href="/processes" { "Processes" }
            a href="/dead-letters" { "Dead letters" }
            a href="/ordered" { "Ordered consumers" }
            a href="/idempotency" { "Idempotency" }
            a href="/audit" { "Audit" }
            " signed in as " b #whoami { (shown(&s.principal.name)) } " (" (s.principal.role) ")"
            form method="post" action="/logout" class="inline" {
                input type="hidden" name="csrf" value=(s.csrf);
                button #logout { "Log out" }
            }
        }
    }
}

/// The console's stylesheet (a file of its own: the content security policy allows no inline
/// style).
pub async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        format!("{STYLE}{}{LOOK}", super::badge::STYLE),
    )
        .into_response()
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;overflow-wrap:anywhere}pre{white-space:pre-wrap}\
.skip{position:absolute;left:-10000px}.skip:focus{position:static;display:inline-block;margin-bottom:.5em}\
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top;font-size:.9em}\
th{background:#f3f3f3}nav a{margin-right:1em}.notice{background:#eef7ee;border:1px solid #9c9;padding:.5em}.dependency-down{background:#fdecea;border:1px solid #d9534f;padding:.5em}\
.error{background:#fbeaea;border:1px solid #d99;padding:.5em}code{font-size:.85em}td code{word-break:break-all}input[type=text]{width:24em}\
form.process-action{border:1px solid #ccc;padding:.5em;margin:.5em 0}form.inline{display:inline}\
.warning{background:#fff4e0;border:2px solid #e0a030;padding:.5em;margin:.5em 0}\
.waiting{background:#eef4ff;border:2px solid #6a8fd0;padding:.5em;margin:.5em 0}\
.card{border:1px solid #bbb;border-radius:4px;padding:.5em .75em;margin:.5em 0;max-width:60em}\
.partitions{display:flex;flex-wrap:wrap;gap:4px;margin:.5em 0 1em}.partition{width:7.5em;padding:.3em;border:2px solid #999;border-radius:3px;font-size:.8em;overflow:hidden}\
.partition.held{border-color:#c33}.card.stuck{border-left:6px solid #c33}.amount{font-size:1.1em}.safe{color:#2a7a2a;font-weight:bold}";

/// The step strip's, the overview's tiles' and charts' and the audit diff's rules.
const LOOK: &str = "svg#strip{max-width:100%;height:auto;border:1px solid #ddd;background:#fff;margin:.5em 0}\
details#history{margin:1em 0}details#history>summary{cursor:pointer}\
.tiles{display:flex;flex-wrap:wrap;gap:.6em;margin:.5em 0 1em}.tile{border:1px solid #bbb;border-radius:5px;padding:.5em .8em;min-width:11em}\
.tile .figure{font-size:1.8em;font-weight:bold;display:block}.tile.alert{border-left:6px solid #c62828}.tile.calm{border-left:6px solid #2e7d32}\
.charts{display:flex;flex-wrap:wrap;gap:1em}.chart{border:1px solid #ddd;padding:.3em .5em;margin:0}.refresh{color:#444}\
.diff-removed{background:#fbe3e3;color:#8a1414;text-decoration:line-through}.diff-added{background:#e2f5e2;color:#145214}\
.diff-changed{font-weight:bold}table.diff td{font-size:.85em}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_redacted_and_escaped_without_a_hand_called_escape() {
        let hostile = "<script>alert(1)</script> \"4111 1111 1111 1111\" & more";
        let h = page(None, hostile, html! { p { (shown(hostile)) } }).0;
        assert!(!h.contains("<script>"), "{h}");
        assert!(
            h.contains("&lt;script&gt;") && h.contains("&amp; more"),
            "{h}"
        );
        assert!(!h.contains("4111 1111"), "card number redacted: {h}");
        assert!(h.contains(redact::MASK), "{h}");
    }
}
