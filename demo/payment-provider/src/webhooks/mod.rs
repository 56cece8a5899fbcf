//! Async confirmation: charges accepted `pending` in async mode are decided later ([`decider`]),
//! every change of such a charge becomes a webhook event ([`events`]), and the events are POSTed,
//! signed ([`signature`]), to `PROVIDER_WEBHOOK_URL` with retries ([`delivery`]). The webhook
//! faults (`webhook_lost`, `webhook_duplicate`, `webhook_delay`, `webhook_reorder`,
//! `webhook_5xx_retry`) strike per event, drawn when it is recorded.
//!
//! Everything is in PostgreSQL (`provider.charges.decide_at`, `provider.events`), so a restart of
//! the simulator decides and delivers what it had not yet.

pub mod decider;
pub mod delivery;
pub mod events;
pub mod signature;

use std::time::Duration;

/// How events are sent: where, signed with what, how often and how patiently.
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// `PROVIDER_WEBHOOK_URL`; without it events are recorded, not sent.
    pub url: Option<String>,
    /// `PROVIDER_WEBHOOK_SECRET`.
    pub secret: String,
    /// How long an async charge stays pending.
    pub confirm_delay: Duration,
    pub max_attempts: u32,
    pub backoff: Duration,
    pub backoff_max: Duration,
    pub timeout: Duration,
    /// `webhook_delay` holds the first delivery this long.
    pub delay: Duration,
    /// `webhook_reorder` holds an event at most this long.
    pub reorder_window: Duration,
}

impl WebhookSettings {
    pub fn from_config(config: &crate::Config) -> Self {
        Self {
            url: config.webhook_url.clone().filter(|u| !u.is_empty()),
            secret: config.webhook_secret.clone().unwrap_or_default(),
            confirm_delay: config.confirm_delay,
            max_attempts: config.webhook_max_attempts.max(1),
            backoff: config.webhook_backoff,
            backoff_max: config.webhook_backoff_max.max(config.webhook_backoff),
            timeout: config.webhook_timeout,
            delay: config.webhook_delay,
            reorder_window: config.webhook_reorder_window,
        }
    }
}

/// How often the decider and the deliverer look for due work.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);
