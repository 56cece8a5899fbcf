//! The simulator's settings: flags with `PROVIDER_*` env var fallbacks.

use crate::faults::FaultSet;
use crate::mode::ConfirmationMode;
use std::net::SocketAddr;
use std::time::Duration;

/// Everything `payment-provider` is configured with.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// PostgreSQL connection string. The simulator keeps its state in the schema `provider`.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/outbox_demo"
    )]
    pub database_url: String,
    /// Address of the HTTP API (and of /metrics, /healthz, /readyz).
    #[arg(long, env = "PROVIDER_ADDR", default_value = "127.0.0.1:8090")]
    pub addr: SocketAddr,
    /// `sync`: POST /charges answers the outcome. `async`: it answers 202 `pending` and the
    /// outcome follows as a signed webhook event (switchable at run time: POST /admin/mode).
    #[arg(long, env = "PROVIDER_MODE", default_value = "sync")]
    pub mode: ConfirmationMode,
    /// Where the webhook events of async mode are POSTed; unset, they are recorded
    /// (GET /admin/events) but not sent.
    #[arg(long, env = "PROVIDER_WEBHOOK_URL")]
    pub webhook_url: Option<String>,
    /// The secret the events are signed with (Provider-Signature: t=..,v1=HMAC-SHA256). Required
    /// with PROVIDER_WEBHOOK_URL.
    #[arg(long, env = "PROVIDER_WEBHOOK_SECRET", hide_env_values = true)]
    pub webhook_secret: Option<String>,
    /// How long an async charge stays pending before it is decided.
    #[arg(long, env = "PROVIDER_CONFIRM_DELAY", default_value = "2s", value_parser = humantime::parse_duration)]
    pub confirm_delay: Duration,
    /// Deliveries of one event before the provider gives up on it (first attempt included).
    #[arg(long, env = "PROVIDER_WEBHOOK_MAX_ATTEMPTS", default_value_t = 8)]
    pub webhook_max_attempts: u32,
    /// First retry delay of a failed delivery; it doubles (with jitter) up to
    /// PROVIDER_WEBHOOK_BACKOFF_MAX.
    #[arg(long, env = "PROVIDER_WEBHOOK_BACKOFF", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub webhook_backoff: Duration,
    /// Longest delay between two deliveries of one event.
    #[arg(long, env = "PROVIDER_WEBHOOK_BACKOFF_MAX", default_value = "30s", value_parser = humantime::parse_duration)]
    pub webhook_backoff_max: Duration,
    /// How long one delivery may take before it counts as failed.
    #[arg(long, env = "PROVIDER_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub webhook_timeout: Duration,
    /// How long the webhook_delay fault holds an event's first delivery back.
    #[arg(long, env = "PROVIDER_WEBHOOK_DELAY", default_value = "5s", value_parser = humantime::parse_duration)]
    pub webhook_delay: Duration,
    /// Longest time the webhook_reorder fault holds an event back waiting for a later event of
    /// the same charge to be delivered first.
    #[arg(long, env = "PROVIDER_WEBHOOK_REORDER_WINDOW", default_value = "30s", value_parser = humantime::parse_duration)]
    pub webhook_reorder_window: Duration,
    /// Injected faults: comma-separated `mode:percent` with modes error_before_charge,
    /// timeout_after_charge, reset_after_charge, slow, decline and, for the events of async
    /// mode, webhook_lost, webhook_duplicate, webhook_delay, webhook_reorder, webhook_5xx_retry
    /// (e.g. `decline:5,slow:10,webhook_lost:20`).
    #[arg(long, env = "PROVIDER_FAULTS", default_value = "")]
    pub faults: FaultSet,
    /// An outage from the start: `503` or `429` (with `:<Retry-After seconds>`, default 1)
    /// answers every API call so, before anything is done, until `POST /admin/outage` with
    /// `{"outage": "off"}`; `off` (the default) serves.
    #[arg(long, env = "PROVIDER_OUTAGE", default_value = "off")]
    pub outage: crate::outage::OutageSetting,
    /// `off` ignores Idempotency-Key headers: every POST /charges charges again.
    #[arg(long, env = "PROVIDER_IDEMPOTENCY", default_value = "on", value_parser = parse_switch, action = clap::ArgAction::Set)]
    pub idempotency: bool,
    /// `off` removes the lookup by reference (GET /charges?reference= answers 501).
    #[arg(long, env = "PROVIDER_STATUS_QUERY", default_value = "on", value_parser = parse_switch, action = clap::ArgAction::Set)]
    pub status_query: bool,
    /// Seed of the fault draws, to replay a run; random when unset.
    #[arg(long, env = "PROVIDER_SEED")]
    pub seed: Option<u64>,
    /// How long timeout_after_charge holds the answer back (e.g. 30s, 500ms, 2m).
    #[arg(long, env = "PROVIDER_TIMEOUT_DELAY", default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout_delay: Duration,
    /// How long the slow fault waits before handling a charge.
    #[arg(long, env = "PROVIDER_SLOW_DELAY", default_value = "2s", value_parser = humantime::parse_duration)]
    pub slow_delay: Duration,
    /// Size of the PostgreSQL pool.
    #[arg(long, env = "PROVIDER_DB_MAX_CONNECTIONS", default_value_t = 10)]
    pub db_max_connections: u32,
    /// How long to keep retrying to reach PostgreSQL at start, in seconds.
    #[arg(long, env = "PROVIDER_DB_CONNECT_DEADLINE_SECS", default_value_t = 60)]
    pub db_connect_deadline_secs: u64,
}

/// `on`/`off` (also `true`/`false`, `1`/`0`).
pub fn parse_switch(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "1" => Ok(true),
        "off" | "false" | "0" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches() {
        assert_eq!(parse_switch("OFF"), Ok(false));
        assert!(parse_switch("maybe").is_err());
    }
}
