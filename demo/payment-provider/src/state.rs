//! [`AppState`]: what every handler shares.

use crate::config::Config;
use crate::faults::FaultInjector;
use crate::mode::ModeSwitch;
use crate::webhooks::WebhookSettings;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The pool, the fault injector and the behaviour switches.
#[derive(Debug, Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub faults: Arc<FaultInjector>,
    /// The outage switch ([`crate::outage`]).
    pub outage: Arc<crate::outage::OutageSwitch>,
    pub idempotency: bool,
    pub status_query: bool,
    pub timeout_delay: Duration,
    pub slow_delay: Duration,
    /// Sync or async confirmation, switchable at run time.
    pub mode: Arc<ModeSwitch>,
    /// Where and how the events of async charges are sent.
    pub webhooks: Arc<WebhookSettings>,
    /// Cancelled at shutdown: delayed answers stop waiting.
    pub shutdown: CancellationToken,
}

impl AppState {
    pub fn new(pool: PgPool, config: &Config, shutdown: CancellationToken) -> Self {
        Self {
            pool,
            faults: Arc::new(FaultInjector::new(config.faults, config.seed)),
            outage: Arc::new(crate::outage::OutageSwitch::new(config.outage)),
            idempotency: config.idempotency,
            status_query: config.status_query,
            timeout_delay: config.timeout_delay,
            slow_delay: config.slow_delay,
            mode: Arc::new(ModeSwitch::new(config.mode)),
            webhooks: Arc::new(WebhookSettings::from_config(config)),
            shutdown,
        }
    }

    /// Waits `d`, or until shutdown.
    pub async fn pause(&self, d: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = self.shutdown.cancelled() => {}
        }
    }
}
