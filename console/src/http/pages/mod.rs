//! The web page: server-rendered HTML (no JavaScript, no build step), a session cookie from
//! logging in with a token, a CSRF token and a fresh Idempotency-Key in every form, and only the
//! buttons the user's role allows. A form's action is checked for its CSRF token here, then sent
//! to the API's action route as the session's user ([`crate::http::api::forward`]): the same path as an
//! API request, idempotency layer included.
//!
//! `processes`: the process list and the process page.

mod notice;
mod ordered;
mod processes;

pub use notice::{Notice, NoticeQuery};

use crate::actions::approvals;
use crate::actions::audit;
use crate::actions::{Action, allowed};
use crate::auth::sessions::{self, Session};
use crate::auth::users;
use crate::error::ConsoleError;
use crate::internal_events;
use crate::redact;
use crate::state::AppState;
use crate::targets::dead_letters;
use crate::targets::outbox_dead;
pub use crate::text::url_encode;
use axum::extract::{ConnectInfo, FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use uuid::Uuid;

type Fields = Vec<(String, String)>;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(overview))
        .route("/style.css", get(stylesheet))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/audit", get(audit_page))
        .route("/dead-letters", get(dead_letters_page))
        .route(
            "/idempotency",
            get(idempotency_page).post(idempotency_lookup),
        )
        .route("/ordered", get(ordered::index))
        .route("/consumers/{consumer}/ordered", get(ordered::page_of))
        .route(
            "/ui/consumers/{consumer}/ordered/{action}",
            post(ordered::action),
        )
        .route("/processes", get(processes::list_page))
        .route("/processes/{id}", get(processes::process_page))
        .route(
            "/ui/processes/{id}/actions/{action}",
            post(processes::process_action),
        )
        .route("/ui/outbox/requeue", post(requeue))
        .route("/ui/dead-letters/{consumer}/replay", post(replay))
        .route("/ui/approvals/{id}/approve", post(approve))
        .route("/ui/approvals/{id}/reject", post(reject))
        .layer(axum::middleware::from_fn(html_errors))
}

/// The console's stylesheet (a file of its own: the content security policy allows no inline
/// style).
async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        STYLE,
    )
        .into_response()
}

/// Every error a web route answers is the console's error page: axum's own rejections (a form
/// that does not parse, a path id that is no UUID, a method the route does not take) are plain
/// text or empty, and the console's errors JSON. This gives them the page, keeping their status
/// and headers (`Allow`, `Retry-After`); for a 5xx only "internal error".
async fn html_errors(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_html = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html"));
    if is_html || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let message = if status.is_server_error() {
        "internal error".to_string()
    } else {
        serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string())
    };
    let message = if message.is_empty() {
        status.canonical_reason().unwrap_or("error").to_lowercase()
    } else {
        message
    };
    let h = format!(
        "<p class=\"error\" id=\"error\">{} {}</p><p><a href=\"/\">Back</a></p>",
        status.as_u16(),
        esc(&crate::text::printable(&message))
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    Response::from_parts(parts, axum::body::Body::from(page(None, "Error", &h).0))
}

/// A logged-in browser; without a live session the page answers with the login page.
pub struct WebSession(pub Session);

/// Sends the browser to the login page.
pub struct ToLogin;

impl IntoResponse for ToLogin {
    fn into_response(self) -> Response {
        Redirect::to("/login").into_response()
    }
}

impl FromRequestParts<AppState> for WebSession {
    type Rejection = Response;
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Some(id) = sessions::cookie_value(&parts.headers) else {
            return Err(ToLogin.into_response());
        };
        match sessions::find(&state.pool, &state.schema, &id).await {
            Ok(Some(s)) => Ok(WebSession(s)),
            Ok(None) => Err(ToLogin.into_response()),
            Err(e) => Err(e.into_response()),
        }
    }
}

/// HTML-escapes text (after redaction).
pub fn esc(s: &str) -> String {
    html(&redact::text(s))
}

/// HTML-escapes a value the console made itself (CSRF token, ids): no redaction.
fn html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top;font-size:.9em}\
th{background:#f3f3f3}nav a{margin-right:1em}.notice{background:#eef7ee;border:1px solid #9c9;padding:.5em}\
.error{background:#fbeaea;border:1px solid #d99;padding:.5em}code{font-size:.85em}td code{word-break:break-all}input[type=text]{width:24em}\
form.process-action{border:1px solid #ccc;padding:.5em;margin:.5em 0}form.inline{display:inline}\
.warning{background:#fff4e0;border:2px solid #e0a030;padding:.5em;margin:.5em 0}\
.card{border:1px solid #bbb;border-radius:4px;padding:.5em .75em;margin:.5em 0;max-width:60em}\
.partitions{display:flex;flex-wrap:wrap;gap:4px;margin:.5em 0 1em}.partition{width:7.5em;padding:.3em;border:2px solid #999;border-radius:3px;font-size:.8em;overflow:hidden}\
.partition.held{border-color:#c33}.card.stuck{border-left:6px solid #c33}.amount{font-size:1.1em}.safe{color:#2a7a2a;font-weight:bold}";

fn page(session: Option<&Session>, title: &str, body: &str) -> Html<String> {
    let nav = match session {
        Some(s) => format!(
            "<nav><a href=\"/\">Overview</a><a href=\"/processes\">Processes</a><a href=\"/dead-letters\">Dead letters</a><a href=\"/ordered\">Ordered consumers</a>\
             <a href=\"/idempotency\">Idempotency</a><a href=\"/audit\">Audit</a> \
             signed in as <b id=\"whoami\">{}</b> ({})\
             <form method=\"post\" action=\"/logout\" class=\"inline\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <button id=\"logout\">Log out</button></form></nav>",
            esc(&s.principal.name),
            s.principal.role,
            html(&s.csrf)
        ),
        None => String::new(),
    };
    Html(format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{} · outbox console</title><link rel=\"stylesheet\" href=\"/style.css\"></head>\
         <body>{nav}<h1>{}</h1>{body}</body></html>",
        esc(title),
        esc(title)
    ))
}

/// The console's error page for `e` (its status, its public message).
pub(crate) fn error_page(session: Option<&Session>, e: &ConsoleError) -> Response {
    let body = format!(
        "<p class=\"error\" id=\"error\">{} {}</p><p><a href=\"/\">Back</a></p>",
        e.status().as_u16(),
        esc(&e.public_message())
    );
    (e.status(), page(session, "Error", &body)).into_response()
}

fn hidden(session: &Session) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\"><input type=\"hidden\" name=\"idempotency_key\" value=\"{}\">",
        html(&session.csrf),
        Uuid::new_v4()
    )
}

fn field<'a>(f: &'a Fields, name: &str) -> Option<&'a str> {
    f.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The CSRF check of every form POST: a missing or wrong token is a denied attempt (403).
async fn csrf(state: &AppState, s: &Session, f: &Fields, action: &str) -> Result<(), Response> {
    if field(f, "csrf") == Some(s.csrf.as_str()) {
        return Ok(());
    }
    let e = crate::actions::deny(
        state,
        &s.principal,
        action,
        "web form",
        "",
        "missing or wrong CSRF token".into(),
    )
    .await;
    Err(error_page(Some(s), &e))
}

/// Sends a form's action to the API route `path` with `body`, as the session's user and with the
/// form's Idempotency-Key; returns the status and the JSON answer.
async fn submit(
    state: &AppState,
    session: &Session,
    f: &Fields,
    path: &str,
    body: Value,
) -> (StatusCode, Value) {
    let key = field(f, "idempotency_key").filter(|k| !k.is_empty());
    let response = crate::http::api::forward(state, &session.principal, path, key, &body).await;
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20)
        .await
        .unwrap_or_default();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// The error page for an API answer that is not a success.
fn answer_page(session: &Session, status: StatusCode, body: &Value) -> Response {
    let message = body
        .get("error")
        .and_then(|e| e.as_str())
        .unwrap_or("the action failed");
    let h = format!(
        "<p class=\"error\" id=\"error\">{} {}</p><p><a href=\"/\">Back</a></p>",
        status.as_u16(),
        esc(message)
    );
    (status, page(Some(session), "Error", &h)).into_response()
}

async fn login_page() -> Html<String> {
    login_form(None)
}

fn login_form(message: Option<&str>) -> Html<String> {
    let msg = message
        .map(|m| format!("<p class=\"error\" id=\"error\">{}</p>", esc(m)))
        .unwrap_or_default();
    page(
        None,
        "Log in",
        &format!(
            "{msg}<form method=\"post\" action=\"/login\"><label>Token <input type=\"password\" id=\"token\" name=\"token\" autocomplete=\"off\"></label> \
             <button id=\"login\">Log in</button></form><p>Tokens come from <code>console user create</code>.</p>"
        ),
    )
}

async fn login(
    State(s): State<AppState>,
    ConnectInfo(addr): ConnectInfo<SocketAddr>,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    let ip = addr.ip();
    if !s.limiter.may_try(ip) {
        internal_events::login_failed("rate_limited", ip);
        return (
            StatusCode::TOO_MANY_REQUESTS,
            login_form(Some(&ConsoleError::TooManyAttempts.to_string())),
        )
            .into_response();
    }
    let token = f.get("token").map(|t| t.trim()).unwrap_or("");
    let principal = match users::by_token(&s.pool, &s.schema, token).await {
        Ok(Some(p)) => p,
        Ok(None) => {
            s.limiter.failed(ip);
            internal_events::login_failed("invalid_token", ip);
            return (
                StatusCode::UNAUTHORIZED,
                login_form(Some("unknown or revoked token")),
            )
                .into_response();
        }
        Err(e) => return error_page(None, &e),
    };
    match sessions::create(&s.pool, &s.schema, &principal, s.settings.session_ttl).await {
        Ok((id, _csrf)) => {
            internal_events::login(&principal);
            let mut r = Redirect::to("/").into_response();
            if let Ok(v) = HeaderValue::from_str(&sessions::set_cookie(
                &id,
                s.settings.session_ttl,
                s.settings.cookie_secure,
            )) {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            r
        }
        Err(e) => error_page(None, &e),
    }
}

async fn logout(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    headers: axum::http::HeaderMap,
    Form(f): Form<Fields>,
) -> Response {
    if let Err(r) = csrf(&s, &session, &f, "logout").await {
        return r;
    }
    if let Some(id) = sessions::cookie_value(&headers) {
        let _ = sessions::delete(&s.pool, &s.schema, &id).await;
    }
    let mut r = Redirect::to("/login").into_response();
    if let Ok(v) = HeaderValue::from_str(&sessions::clear_cookie(s.settings.cookie_secure)) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

fn audit_table(entries: &[audit::Entry]) -> String {
    audit_table_with_id("audit", entries)
}

fn audit_table_with_id(id: &str, entries: &[audit::Entry]) -> String {
    let mut h = format!(
        "<table id=\"{id}\"><tr><th>#</th><th>when</th><th>who</th><th>roles</th><th>action</th><th>target</th><th>reason</th><th>approver</th><th>outcome</th><th>before → after</th></tr>",
    );
    for e in entries {
        h.push_str(&format!(
            "<tr class=\"audit-entry\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"outcome\">{}</td><td><code>{}</code> → <code>{}</code></td></tr>",
            e.seq,
            e.at.format("%Y-%m-%d %H:%M:%S"),
            esc(&e.actor_name),
            esc(&e.roles.join(",")),
            esc(&e.action),
            esc(&e.target),
            esc(&e.reason),
            esc(e.approver.as_deref().unwrap_or("")),
            esc(&e.outcome),
            esc(&e.before.as_ref().map(|v| v.to_string()).unwrap_or_default()),
            esc(&e.after.as_ref().map(|v| v.to_string()).unwrap_or_default()),
        ));
    }
    h.push_str("</table>");
    h
}

async fn overview(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(n): Query<NoticeQuery>,
) -> Response {
    match render_overview(&s, &session, &n).await {
        Ok(h) => h.into_response(),
        Err(e) => error_page(Some(&session), &e),
    }
}

async fn render_overview(
    s: &AppState,
    session: &Session,
    notice: &NoticeQuery,
) -> Result<Html<String>, ConsoleError> {
    let p = &session.principal;
    let backlog = outbox_dead::backlog(&s.pool, &s.schema).await?;
    let dead = outbox_dead::list(&s.pool, &s.schema, 200).await?;
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
    let may_requeue = allowed(p.role, Action::OutboxRequeue);
    let mut h = notice.html();
    let in_review = s.processes.in_manual_review(&s.pool).await?;
    h.push_str(&format!(
        "<h2>Processes</h2><p id=\"manual-review\"><a href=\"/processes?status=manual_review\">{in_review} in manual review</a> · \
         <a href=\"/processes\">all processes</a></p>"
    ));
    h.push_str(&format!(
        "<h2>Outbox</h2><p id=\"backlog\">pending <b>{}</b> (oldest {:.0} s) · dead <b id=\"dead-count\">{}</b></p>",
        backlog.pending, backlog.oldest_pending_seconds, backlog.dead
    ));
    h.push_str("<h2>Dead outbox rows</h2>");
    if may_requeue {
        h.push_str(&format!(
            "<form method=\"post\" action=\"/ui/outbox/requeue\" id=\"requeue-form\">{}",
            hidden(session)
        ));
    }
    h.push_str("<table id=\"dead-rows\"><tr><th></th><th>id</th><th>event</th><th>aggregate</th><th>attempts</th><th>last error</th><th>version</th></tr>");
    for r in &dead {
        let check = if may_requeue && r.unpublishable.is_none() {
            format!(
                "<input type=\"checkbox\" name=\"item\" id=\"item-{}\" value=\"{}:{}\">",
                r.id, r.id, r.version
            )
        } else {
            r.unpublishable
                .as_deref()
                .map(|u| format!("stays dead: {}", esc(u)))
                .unwrap_or_default()
        };
        h.push_str(&format!(
            "<tr class=\"dead-row\"><td>{check}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            r.id,
            esc(&r.event_type),
            esc(&r.aggregate_type),
            esc(&r.aggregate_id),
            r.attempts,
            esc(r.last_error.as_deref().unwrap_or("")),
            r.version
        ));
    }
    h.push_str("</table>");
    if may_requeue {
        h.push_str(
            "<label>Reason <input type=\"text\" name=\"reason\" id=\"requeue-reason\"></label> \
             <button name=\"dry_run\" value=\"1\" id=\"requeue-dry-run\">Dry run</button> \
             <button name=\"go\" value=\"1\" id=\"requeue-submit\">Requeue selected</button> \
             <small>one row runs now; more than one asks an approver</small></form>",
        );
    }
    h.push_str("<h2>Approval requests</h2>");
    h.push_str(&approvals_table(session, &pending, None));
    h.push_str("<h2>Recent audit entries</h2>");
    h.push_str(&audit_table(&recent));
    Ok(page(Some(session), "Operations console", &h))
}

/// Approval requests, with approve and reject forms for an approver who did not make them;
/// `back`: the page to return to after a decision (a process page), else the overview.
fn approvals_table(session: &Session, list: &[approvals::Approval], back: Option<&str>) -> String {
    let p = &session.principal;
    let may_decide = allowed(p.role, Action::ApprovalApprove);
    let back = back
        .map(|b| {
            format!(
                "<input type=\"hidden\" name=\"back\" value=\"{}\">",
                html(b)
            )
        })
        .unwrap_or_default();
    let mut h = String::from("<div id=\"approvals\">");
    if list.is_empty() {
        h.push_str("<p>None.</p>");
    }
    for a in list {
        let decide = if a.status == "pending" && may_decide && a.requested_by != p.name {
            format!(
                "<form method=\"post\" action=\"/ui/approvals/{id}/approve\">{}{back}<input type=\"hidden\" name=\"version\" value=\"{}\">\
                 <input type=\"text\" name=\"reason\" id=\"approval-reason-{id}\" placeholder=\"reason\"> \
                 <button id=\"approve-{id}\">Approve</button> \
                 <button formaction=\"/ui/approvals/{id}/reject\" id=\"reject-{id}\">Reject</button></form>",
                hidden(session),
                a.version,
                id = a.id
            )
        } else if a.status == "pending" {
            "waiting for another approver".to_string()
        } else {
            String::new()
        };
        let decided = match (&a.decided_by, a.status.as_str()) {
            (Some(by), _) => format!(" by {}", esc(by)),
            (None, "superseded") => {
                " (what it was about changed since the request: nothing ran; ask again if still needed)"
                    .to_string()
            }
            _ => String::new(),
        };
        h.push_str(&format!(
            "<div class=\"approval card\" id=\"approval-{id}\"><p><b>{}</b> · <span class=\"status\">{}</span>{decided}</p>\
             {}<p>Asked by <b>{}</b> at {}: {}</p>{}{decide}\
             <details><summary>request as stored</summary><code>{}</code></details></div>",
            esc(&approval_title(a)),
            esc(&a.status),
            approval_terms(a),
            esc(&a.requested_by),
            a.requested_at.format("%Y-%m-%d %H:%M:%S"),
            esc(&a.reason),
            a.result
                .as_ref()
                .map(|r| format!("<p>Result: <code>{}</code></p>", esc(&r.to_string())))
                .unwrap_or_default(),
            esc(&a.request.to_string()),
            id = a.id,
        ));
    }
    h.push_str("</div>");
    h
}

/// What an approval does, in words.
fn approval_title(a: &approvals::Approval) -> String {
    let r = &a.request;
    let n = r["items"].as_array().map(Vec::len).unwrap_or(0);
    match r["kind"].as_str() {
        Some("outbox_requeue") => format!("Requeue {n} dead outbox rows"),
        Some("dlq_replay") => format!(
            "Replay {n} dead letters of {}",
            r["consumer"].as_str().unwrap_or("?")
        ),
        Some("ordered_discard") => {
            let what = if r["discard"] == json!("run") {
                "Dead-letter everything held"
            } else {
                "Skip the head"
            };
            format!(
                "{what} of {}/{} (ordered consumer {})",
                r["aggregate_type"].as_str().unwrap_or("?"),
                r["aggregate_id"].as_str().unwrap_or("?"),
                r["consumer"].as_str().unwrap_or("?")
            )
        }
        Some("process") => {
            let step = &r["request"]["step"];
            let what = match r["action"].as_str() {
                Some("run_compensation") => "Run the compensation (e.g. a refund)",
                Some("resolve_succeeded") => "Resolve as succeeded",
                Some("resolve_failed") => "Resolve as failed (the outcome was unknown)",
                _ => "Process action",
            };
            if step.is_null() {
                what.to_string()
            } else {
                format!("{what}: step {step}")
            }
        }
        _ => a.action.clone(),
    }
}

/// A process request in business terms: amount and currency, order, customer, payment, the
/// process as it is now (status, version) with a link, and the evidence given.
fn approval_terms(a: &approvals::Approval) -> String {
    if a.request["kind"] == json!("ordered_discard") {
        return ordered_terms(&a.request);
    }
    let Some(p) = &a.process else {
        return String::new();
    };
    let input = &p["input"];
    let field = |k: &str| {
        input.get(k).filter(|v| !v.is_null()).map(|v| {
            v.as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string())
        })
    };
    let mut terms = Vec::new();
    if let Some(amount) = field("amount") {
        terms.push(format!(
            "amount <b class=\"amount\">{} {}</b>",
            esc(&amount),
            esc(&field("currency").unwrap_or_default())
        ));
    }
    for (label, key) in [
        ("order", "order_id"),
        ("customer", "customer_id"),
        ("payment", "payment_id"),
        ("tenant", "tenant"),
    ] {
        if let Some(v) = field(key) {
            terms.push(format!("{label} <code>{}</code>", esc(&v)));
        }
    }
    let id = p["id"].as_str().unwrap_or("");
    terms.push(format!(
        "process <a href=\"/processes/{}\">{} {}</a>, now <b>{}</b>{} at version {} (asked at version {})",
        html(id),
        esc(p["kind"].as_str().unwrap_or("")),
        esc(p["business_key"].as_str().unwrap_or("")),
        esc(p["status"].as_str().unwrap_or("")),
        if p["paused"] == json!(true) { " (paused)" } else { "" },
        esc(&p["version"].to_string()),
        esc(&a.request["request"]["version"].to_string()),
    ));
    let req = &a.request["request"];
    if let Some(e) = req["evidence"].as_str() {
        terms.push(format!("evidence <code>{}</code>", esc(e)));
    }
    if let Some(c) = req.get("remote_check").filter(|c| c.is_object()) {
        terms.push(format!(
            "checked at the remote: {}; its answer: {}",
            esc(c["checked"].as_str().unwrap_or("")),
            esc(c["answer"].as_str().unwrap_or(""))
        ));
    }
    format!("<p class=\"terms\">{}</p>", terms.join(" · "))
}

/// A skip or dead-lettered run in the approver's terms: the aggregate and the position seen, and
/// each message it dead-letters (number, event, payload as it was when asked), or the missing
/// number it passes over.
fn ordered_terms(r: &Value) -> String {
    let consumer = r["consumer"].as_str().unwrap_or("");
    let mut h = format!(
        "<p class=\"terms\">consumer <a href=\"/consumers/{}/ordered\">{}</a> · aggregate <code>{}/{}</code> · applied up to <b>{}</b> when asked</p>",
        html(&url_encode(consumer)),
        esc(consumer),
        esc(r["aggregate_type"].as_str().unwrap_or("")),
        esc(r["aggregate_id"].as_str().unwrap_or("")),
        esc(&r["version"].to_string()),
    );
    let messages = r["messages"].as_array().cloned().unwrap_or_default();
    if messages.is_empty() {
        h.push_str(&format!(
            "<p class=\"warning\">Passes over the missing message {}: it will never be applied if it arrives later.</p>",
            r["version"].as_i64().map(|v| v + 1).unwrap_or_default()
        ));
    } else {
        h.push_str("<p class=\"warning\">These messages will be dead-lettered: their effects are not applied.</p><table><tr><th>seq</th><th>event</th><th>payload</th></tr>");
        for m in &messages {
            h.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
                esc(&m["aggregate_seq"].to_string()),
                esc(m["event_type"].as_str().unwrap_or("")),
                esc(&m["payload"].to_string())
            ));
        }
        h.push_str("</table>");
    }
    h
}

/// Back to `path` (a page of the console) with the notice for the action's answer `v`.
fn notice_redirect_to(path: &str, v: &Value) -> Response {
    Redirect::to(&Notice::of_answer(v).url(path, v)).into_response()
}

async fn requeue(
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
    let dry_run = field(&f, "dry_run").is_some();
    let body = json!({
        "reason": field(&f, "reason").unwrap_or(""),
        "items": items,
        "dry_run": dry_run,
    });
    match submit(&s, &session, &f, "/api/outbox/dead/actions/requeue", body).await {
        (status, v) if status.is_success() && dry_run => plan_page(&session, &v),
        (status, v) if status.is_success() => notice_redirect_to("/", &v),
        (status, v) => answer_page(&session, status, &v),
    }
}

fn plan_page(session: &Session, v: &Value) -> Response {
    let mut h =
        String::from("<table id=\"plan\"><tr><th>item</th><th>would</th><th>detail</th></tr>");
    for i in v
        .get("items")
        .and_then(|i| i.as_array())
        .into_iter()
        .flatten()
    {
        let id = i
            .get("id")
            .or_else(|| i.get("message_id"))
            .map(|x| x.to_string())
            .unwrap_or_default();
        h.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(id.trim_matches('"')),
            esc(i.get("would").and_then(|w| w.as_str()).unwrap_or("")),
            esc(i.get("detail").and_then(|w| w.as_str()).unwrap_or(""))
        ));
    }
    h.push_str("</table>");
    if v.get("needs_approval").and_then(|b| b.as_bool()) == Some(true) {
        h.push_str("<p>More than one item: running it creates an approval request.</p>");
    }
    h.push_str("<p><a href=\"/\">Overview</a></p>");
    page(Some(session), "Dry run", &h).into_response()
}

#[derive(Debug, Deserialize)]
pub struct ConsumerQuery {
    consumer: Option<String>,
}

async fn dead_letters_page(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Query(q): Query<ConsumerQuery>,
) -> Response {
    let mut h = String::from(
        "<form method=\"get\"><label>Consumer <input type=\"text\" name=\"consumer\"></label> <button>Show</button></form>",
    );
    if !s.settings.consumers.is_empty() {
        h.push_str("<p>");
        for c in &s.settings.consumers {
            h.push_str(&format!(
                "<a href=\"/dead-letters?consumer={0}\">{0}</a> ",
                esc(c)
            ));
        }
        h.push_str("</p>");
    }
    if let Some(c) = q.consumer.as_deref().filter(|c| !c.is_empty()) {
        // Not in CONSOLE_CONSUMERS: a 404, like the API's.
        if let Err(e) = dead_letters::listed(&s.settings.consumers, c) {
            return error_page(Some(&session), &e);
        }
        match dead_letters::list(&s.settings.amqp_url, &s.settings.amqp_tls, c, 200).await {
            Ok(letters) => {
                let may = allowed(session.principal.role, Action::DlqReplay);
                if may {
                    h.push_str(&format!(
                        "<form method=\"post\" action=\"/ui/dead-letters/{}/replay\">{}",
                        html(&url_encode(c)),
                        hidden(&session)
                    ));
                }
                h.push_str("<table id=\"dead-letters\"><tr><th></th><th>message id</th><th>event</th><th>kind</th><th>reason</th><th>attempts</th><th>dead-lettered at</th><th>payload</th></tr>");
                for l in &letters {
                    let check = match (&l.message_id, may) {
                        (Some(id), true) => format!(
                            "<input type=\"checkbox\" name=\"item\" value=\"{}|{}\">",
                            esc(id),
                            esc(&l.version)
                        ),
                        _ => String::new(),
                    };
                    h.push_str(&format!(
                        "<tr><td>{check}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
                        esc(l.message_id.as_deref().unwrap_or("")),
                        esc(&l.event_type),
                        esc(&l.kind),
                        esc(&l.reason),
                        l.attempts.map(|a| a.to_string()).unwrap_or_default(),
                        esc(l.dead_lettered_at.as_deref().unwrap_or("")),
                        esc(&l.payload.to_string()),
                    ));
                }
                h.push_str("</table>");
                if may {
                    h.push_str("<label>Reason <input type=\"text\" name=\"reason\"></label> <button name=\"dry_run\" value=\"1\">Dry run</button> <button name=\"go\" value=\"1\">Replay selected</button></form>");
                }
            }
            Err(e) => h.push_str(&format!(
                "<p class=\"error\">{}</p>",
                esc(&e.public_message())
            )),
        }
    }
    page(Some(&session), "Consumer dead letters", &h).into_response()
}

async fn replay(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(consumer): Path<String>,
    Form(f): Form<Fields>,
) -> Response {
    if let Err(r) = csrf(&s, &session, &f, Action::DlqReplay.name()).await {
        return r;
    }
    let items: Vec<dead_letters::Item> = f
        .iter()
        .filter(|(k, _)| k == "item")
        .filter_map(|(_, v)| v.split_once('|'))
        .map(|(id, ver)| dead_letters::Item {
            message_id: id.to_string(),
            version: ver.to_string(),
        })
        .collect();
    let dry_run = field(&f, "dry_run").is_some();
    let body = json!({
        "reason": field(&f, "reason").unwrap_or(""),
        "items": items,
        "dry_run": dry_run,
    });
    let path = format!("/api/dead-letters/{}/actions/replay", url_encode(&consumer));
    match submit(&s, &session, &f, &path, body).await {
        (status, v) if status.is_success() && dry_run => plan_page(&session, &v),
        (status, v) if status.is_success() => notice_redirect_to("/", &v),
        (status, v) => answer_page(&session, status, &v),
    }
}

async fn decide(s: AppState, session: Session, id: Uuid, f: Fields, approve: bool) -> Response {
    let action = if approve {
        Action::ApprovalApprove
    } else {
        Action::ApprovalReject
    };
    if let Err(r) = csrf(&s, &session, &f, action.name()).await {
        return r;
    }
    let Some(version) = field(&f, "version").and_then(|v| v.parse::<i32>().ok()) else {
        return error_page(
            Some(&session),
            &ConsoleError::BadRequest("version missing".into()),
        );
    };
    let verb = if approve { "approve" } else { "reject" };
    let body = json!({"reason": field(&f, "reason").unwrap_or(""), "version": version});
    // Back to the page the form was on: the overview, or a process page.
    let back = field(&f, "back")
        .and_then(back_page)
        .unwrap_or_else(|| "/".to_string());
    match submit(
        &s,
        &session,
        &f,
        &format!("/api/approvals/{id}/{verb}"),
        body,
    )
    .await
    {
        (status, v) if status.is_success() => notice_redirect_to(&back, &v),
        (status, v) => answer_page(&session, status, &v),
    }
}

/// The console page a decision form may return to: a process page or an ordered consumer's page
/// (rebuilt from what it names, so no form can send the browser elsewhere).
fn back_page(back: &str) -> Option<String> {
    if let Some(id) = back.strip_prefix("/processes/") {
        return id.parse::<Uuid>().ok().map(|id| format!("/processes/{id}"));
    }
    let consumer = back.strip_prefix("/consumers/")?.strip_suffix("/ordered")?;
    let plain = !consumer.is_empty()
        && consumer
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    plain.then(|| format!("/consumers/{consumer}/ordered"))
}

async fn approve(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(id): Path<Uuid>,
    Form(f): Form<Fields>,
) -> Response {
    decide(s, session, id, f, true).await
}

async fn reject(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(id): Path<Uuid>,
    Form(f): Form<Fields>,
) -> Response {
    decide(s, session, id, f, false).await
}

async fn audit_page(
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
    let v = |o: &Option<String>| esc(o.as_deref().unwrap_or(""));
    let h = format!(
        "<form method=\"get\">actor <input name=\"actor\" value=\"{}\"> action <input name=\"action\" value=\"{}\"> \
         outcome <input name=\"outcome\" value=\"{}\"> target <input name=\"target\" value=\"{}\"> <button>Filter</button></form>\
         <p>Export: <code>GET /api/audit?format=jsonl</code> or <code>console audit export</code>. Retention: {} days.</p>{}",
        v(&f.actor),
        v(&f.action),
        v(&f.outcome),
        v(&f.target),
        s.settings.audit_retention_days,
        audit_table(&entries)
    );
    page(Some(&session), "Audit log", &h).into_response()
}

/// The lookup form: a POST, so the key never travels in a URL (history, logs, `Referer`).
fn idempotency_form(session: &Session) -> String {
    format!(
        "<form method=\"post\" action=\"/idempotency\" id=\"idempotency-form\"><input type=\"hidden\" name=\"csrf\" value=\"{}\">\
         scope <input name=\"scope\" id=\"idempotency-scope\"> key <input name=\"key\" type=\"password\" id=\"idempotency-key\"> \
         <button id=\"idempotency-lookup\">Look up</button></form>\
         <p>Status and times only; request and response bodies are never shown.</p>",
        html(&session.csrf)
    )
}

async fn idempotency_page(WebSession(session): WebSession) -> Response {
    page(
        Some(&session),
        "Idempotency records",
        &idempotency_form(&session),
    )
    .into_response()
}

async fn idempotency_lookup(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Form(f): Form<Fields>,
) -> Response {
    if let Err(r) = csrf(&s, &session, &f, "idempotency.lookup").await {
        return r;
    }
    let mut h = idempotency_form(&session);
    if let (Some(scope), Some(key)) = (field(&f, "scope"), field(&f, "key")) {
        match crate::http::api::lookup_idempotency(&s, scope, key).await {
            Ok(rows) => {
                h.push_str("<table><tr><th>operation</th><th>status</th><th>response</th><th>resource</th><th>created</th><th>updated</th><th>expires</th></tr>");
                for r in rows {
                    h.push_str(&format!(
                        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                        esc(&r.operation),
                        esc(&r.status),
                        r.response_status.map(|s| s.to_string()).unwrap_or_default(),
                        r.resource_id.map(|s| s.to_string()).unwrap_or_default(),
                        r.created_at,
                        r.updated_at,
                        r.expires_at
                    ));
                }
                h.push_str("</table>");
            }
            Err(e) => h.push_str(&format!(
                "<p class=\"error\">{}</p>",
                esc(&e.public_message())
            )),
        }
    }
    page(Some(&session), "Idempotency records", &h).into_response()
}
