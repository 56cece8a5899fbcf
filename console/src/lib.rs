//! The operations console: one process serving a JSON API (bearer tokens), a server-rendered web
//! page (session cookie, CSRF tokens) and `/metrics`, `/healthz`, `/readyz`, on the product schema.
//! The `console` binary's other subcommands are clients of the API, so the page, the API and the
//! CLI obey the same rules.
//!
//! **Tables.** The console owns `console_users`, `console_sessions`, `console_audit` and
//! `console_approvals`. Everything else it reads or changes through the crate that owns it: dead
//! outbox rows are requeued by `relay::store::requeue_dead_in`, idempotency records are looked up
//! by `idempotency::Idempotency::lookup`, processes are read and acted on by `processes::admin`,
//! ordered consumers by `consumer::ordered::admin`, dead letters by `consumer::dlq`, consumer
//! names checked by `consumer::config::validate_name`.
//!
//! **Folders**, each a layer that uses only the ones below it (no module cycle):
//! - [`cli`]: the `console` binary's subcommands: clap arguments, typed API client, printing.
//! - [`http`]: the API by target, its DTOs and OpenAPI document, the pages (maud templates,
//!   escaped by default), headers, cross-site refusal, the idempotency layer, starting the server.
//! - [`actions`]: the role matrix, the caller of an action, how an action runs (role check, effect
//!   and audit in one transaction, 409 on a stale version), the actions, four-eyes approvals, the
//!   audit log.
//! - [`state`]: what every handler shares.
//! - [`targets`]: dead outbox rows, consumer dead letters, processes, ordered consumers.
//! - [`auth`]: roles, users, sessions, Idempotency-Key scopes.
//! - [`internal_events`] (metrics and logs), [`config`], [`error`], [`text`] (no control
//!   character in any input), [`redact`] (what never leaves the console), [`money`] (amounts in
//!   their currency's major units).

pub mod actions;
pub mod auth;
pub mod cli;
pub mod config;
pub mod error;
pub mod http;
pub mod internal_events;
pub mod money;
pub mod redact;
pub mod state;
pub mod targets;
pub mod text;

pub use config::ServeConfig;
pub use error::ConsoleError;
pub use http::router;
pub use http::serve::{Running, StartError, run, start};
pub use state::AppState;

/// Paths kept for the tests and tools written against the flat layout.
pub use actions::audit;
pub use auth::users;

/// Roles and the role matrix, as one path (`console::roles::{Role, Action, allowed}`).
pub mod roles {
    pub use crate::actions::matrix::{Action, allowed};
    pub use crate::auth::roles::*;
}

/// What the pages' helpers offered to other crates.
pub mod web {
    pub use crate::text::url_encode;
}
