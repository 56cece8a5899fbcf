//! What every request handler shares.

use crate::auth::sessions::LoginLimiter;
pub use crate::config::Settings;
use shared::schema::Schema;
use sqlx::PgPool;
use std::sync::Arc;

/// The handlers' state.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub schema: Schema,
    pub settings: Arc<Settings>,
    /// Processes: the processes crate's admin module ([`crate::targets::processes::Admin`]).
    pub processes: crate::targets::processes::Admin,
    /// Where the actions' Idempotency-Keys are kept ([`crate::auth::keys`]).
    pub idempotency: idempotency::Idempotency,
    pub limiter: Arc<LoginLimiter>,
}
