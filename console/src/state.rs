//! What every request handler shares.

use crate::sessions::LoginLimiter;
use shared::schema::Schema;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;

/// Settings the handlers read.
#[derive(Debug, Clone)]
pub struct Settings {
    /// RabbitMQ (URL, TLS files), for consumer dead letters.
    pub amqp_url: String,
    pub amqp_tls: plumbing::amqp_tls::AmqpTls,
    /// Consumers whose dead letters the web page offers.
    pub consumers: Vec<String>,
    /// Web session lifetime.
    pub session_ttl: Duration,
    /// Mark the session cookie `Secure` (serve over HTTPS, e.g. behind a proxy).
    pub cookie_secure: bool,
    /// Audit entries older than this are purged (admin action `audit.purge`).
    pub audit_retention_days: u32,
    /// An ordered consumer's aggregate waiting this long for a missing message shows as stuck.
    pub ordered_gap_after: Duration,
}

/// The handlers' state.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub schema: Schema,
    pub settings: Arc<Settings>,
    /// Processes: the processes crate's admin module ([`crate::processes::Admin`]).
    pub processes: crate::processes::Admin,
    /// Where the actions' Idempotency-Keys are kept ([`crate::keys`]).
    pub idempotency: idempotency::Idempotency,
    pub limiter: Arc<LoginLimiter>,
}
