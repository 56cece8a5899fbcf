//! The web pages: server-rendered HTML from maud templates (escaped by default; no JavaScript, no
//! build step), a session cookie from logging in with a token, a CSRF token and a fresh
//! Idempotency-Key in every form, and only the buttons the user's role allows. A form's action is
//! checked for its CSRF token ([`forms::csrf`]), then sent to the API's action route as the
//! session's user ([`crate::http::api::forward`]): the same path as an API request, idempotency
//! layer included.
//!
//! One file a page: [`overview`], [`processes`], [`dead_letters`], [`ordered`], [`idempotency`],
//! [`audit`], [`login`]; shared parts: [`layout`], [`errors`], [`forms`], [`session`],
//! [`notice`], [`approvals`] (the approval cards several pages show), [`badge`] (status colours),
//! [`charts`] (the overview's SVG charts), [`links`] (where names link to); [`messages`]: an
//! aggregate's outbox messages.

pub mod approvals;
pub mod audit;
pub mod badge;
pub mod charts;
pub mod dashboard;
pub mod dead_letter;
pub mod dead_letters;
pub mod dead_row;
pub mod dependencies;
pub mod diff;
pub mod errors;
pub mod forms;
pub mod idempotency;
pub mod item;
pub mod layout;
pub mod links;
pub mod login;
pub mod messages;
pub mod notice;
pub mod ordered;
pub mod overview;
pub mod paging;
pub mod processes;
pub mod session;

pub use errors::error_page;
pub use notice::{Notice, NoticeQuery};
pub use session::WebSession;

use crate::state::AppState;
use axum::Router;
use axum::routing::{get, post};

/// Every page and form route.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(overview::overview))
        .route("/style.css", get(layout::stylesheet))
        .route("/login", get(login::login_page).post(login::login))
        .route("/logout", post(login::logout))
        .route("/audit", get(audit::audit_page))
        .route("/dead-letters", get(dead_letters::dead_letters_page))
        .route(
            "/dead-letters/{consumer}/{message_id}",
            get(dead_letter::dead_letter_page),
        )
        .route(
            "/idempotency",
            get(idempotency::idempotency_page).post(idempotency::idempotency_lookup),
        )
        .route("/ordered", get(ordered::index))
        .route("/consumers/{consumer}/ordered", get(ordered::page_of))
        .route(
            "/ui/consumers/{consumer}/ordered/{action}",
            post(ordered::action),
        )
        .route("/messages", get(messages::messages_page))
        .route("/outbox/dead/{id}", get(dead_row::dead_row_page))
        .route("/processes", get(processes::list_page))
        .route("/processes/{id}", get(processes::page::process_page))
        .route(
            "/ui/processes/{id}/actions/{action}",
            post(processes::actions::process_action),
        )
        .route("/ui/outbox/requeue", post(overview::requeue))
        .route("/ui/dependencies/{name}", post(dependencies::act))
        .route("/ui/processes/bulk", post(processes::bulk::bulk))
        .route(
            "/ui/dead-letters/{consumer}/replay",
            post(dead_letters::replay),
        )
        .route("/ui/approvals/{id}/approve", post(approvals::approve))
        .route("/ui/approvals/{id}/reject", post(approvals::reject))
        .layer(axum::middleware::from_fn(errors::html_errors))
}
