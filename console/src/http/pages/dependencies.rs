//! The dependencies on the overview: a line per remote that is down, at the top ("provider down
//! since 12:03:07 UTC (circuit open): 478 payment processes waiting"), and a table of every
//! dependency with the forms to hold its circuit open or close it (operators).

use super::errors::error_page;
use super::forms::{Fields, answered, csrf, field, hidden, submit};
use super::layout::shown;
use super::session::WebSession;
use crate::actions::{Action, allowed};
use crate::auth::sessions::Session;
use crate::error::ConsoleError;
use crate::state::AppState;
use crate::targets::dependencies::Dependency;
use axum::Form;
use axum::extract::{Path, State};
use axum::response::Response;
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use serde_json::json;

fn at(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_default()
}

/// What a circuit is, in words.
fn state_words(d: &Dependency) -> &'static str {
    if d.circuit.forced_open {
        return "circuit held open by an operator";
    }
    match d.circuit.state {
        breaker::CircuitState::Closed => "up",
        breaker::CircuitState::Open => "circuit open",
        breaker::CircuitState::HalfOpen => "circuit half open, probing",
    }
}

/// "478 payment processes, 3 refund processes waiting".
fn waiting_words(d: &Dependency) -> String {
    if d.waiting.is_empty() {
        return "nothing waiting".into();
    }
    let parts: Vec<String> = d
        .waiting
        .iter()
        .map(|w| {
            format!(
                "{} {} process{}",
                w.count,
                shown(&w.kind),
                if w.count == 1 { "" } else { "es" }
            )
        })
        .collect();
    format!("{} waiting", parts.join(", "))
}

/// The lines for the remotes that are down: the first thing the overview says.
pub fn down_lines(deps: &[Dependency]) -> Markup {
    html! {
        @for d in deps.iter().filter(|d| d.is_down()) {
            p.dependency-down id={ "dependency-down-" (d.circuit.name) } {
                b { (shown(&d.circuit.name)) " down" }
                @if let Some(since) = d.circuit.down_since { " since " (at(Some(since))) }
                " (" (state_words(d)) "): " (waiting_words(d))
                @if let Some(e) = &d.circuit.last_error { " · last answer: " (shown(e)) }
            }
        }
    }
}

/// Every dependency, with the open and close forms for those who may use them.
pub fn table(session: &Session, deps: &[Dependency]) -> Markup {
    if deps.is_empty() {
        return html! { p #dependencies { "No dependency declared yet (a step or handler names one on its first call)." } };
    }
    let may = allowed(session.principal.role, Action::DependencyCircuit(true));
    html! {
        table #dependencies {
            tr {
                th { "dependency" } th { "state" } th { "down since" } th { "next probe" }
                th { "waiting" } th { "last answer" }
                @if may { th { "by hand" } }
            }
            @for d in deps {
                tr.dependency id={ "dependency-" (d.circuit.name) } {
                    td { (shown(&d.circuit.name)) }
                    td { (state_words(d)) }
                    td { (at(d.circuit.down_since)) }
                    td { (at(d.circuit.probe_at.filter(|_| !d.circuit.forced_open))) }
                    td { (waiting_words(d)) }
                    td { (shown(d.circuit.last_error.as_deref().unwrap_or(""))) }
                    @if may {
                        td {
                            form method="post" action={ "/ui/dependencies/" (d.circuit.name) } {
                                (hidden(session))
                                label { "Reason " input type="text" name="reason" required; }
                                " "
                                @if d.circuit.forced_open || d.circuit.state != breaker::CircuitState::Closed {
                                    button name="action" value="close" { "Close the circuit" }
                                } @else {
                                    button name="action" value="open" { "Hold the circuit open" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `POST /ui/dependencies/{name}` with `action` (open or close) and a reason.
pub async fn act(
    State(s): State<AppState>,
    WebSession(session): WebSession,
    Path(name): Path<String>,
    Form(f): Form<Fields>,
) -> Response {
    let open = match field(&f, "action") {
        Some("open") => true,
        Some("close") => false,
        _ => {
            return error_page(
                Some(&session),
                &ConsoleError::BadRequest("action must be open or close".into()),
            );
        }
    };
    let action = Action::DependencyCircuit(open);
    if let Err(r) = csrf(&s, &session, &f, action.name()).await {
        return r;
    }
    let path = format!(
        "/api/dependencies/{}/actions/{}",
        crate::text::url_encode(&name),
        if open { "open" } else { "close" }
    );
    let body = json!({ "reason": field(&f, "reason").unwrap_or("") });
    answered(&session, "/", submit(&s, &session, &f, &path, body).await)
}
