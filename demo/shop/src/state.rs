//! The state every handler shares: the pool, the settings, the idempotency store with its clock,
//! and the fault-injection hook.

use crate::config::Settings;
use crate::fault::{FaultHook, InjectedFault, Operation, Stage};
use chrono::{DateTime, TimeDelta, Utc};
use idempotency::Idempotency;
use plumbing::telemetry::Readiness;
use sqlx::PgPool;
use std::sync::{Arc, Mutex};

/// The application clock. Every time the producer stores or compares (reservation, lease, expiry,
/// created_at) comes from it, never from the database, so tests move time without sleeping.
pub use idempotency::Clock;

/// The wall clock.
pub fn system_clock() -> Clock {
    Arc::new(Utc::now)
}

/// A clock that only moves when told to, for tests.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            now: Arc::new(Mutex::new(start)),
        }
    }
    pub fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn advance(&self, by: std::time::Duration) {
        let by = TimeDelta::from_std(by).expect("duration in range");
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        *now += by;
    }
    /// This clock as a [`Clock`] for [`AppState::with_clock`].
    pub fn clock(&self) -> Clock {
        let this = self.clone();
        Arc::new(move || this.now())
    }
}

/// Shared state of the router: cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) pool: PgPool,
    pub(crate) settings: Settings,
    pub(crate) idempotency: Idempotency,
    pub(crate) fault_hook: Option<FaultHook>,
    pub(crate) readiness: Arc<Readiness>,
}

impl AppState {
    /// State over a connected pool whose schema is migrated, with the system clock and no hook.
    pub fn new(pool: PgPool, settings: Settings) -> Self {
        let readiness = Readiness::without_rabbitmq();
        readiness.set_postgres(true);
        let idempotency = Idempotency::new(pool.clone())
            .schema(settings.schema.clone())
            .ttl(settings.idempotency_ttl)
            .lease(settings.lease);
        Self {
            pool,
            settings,
            idempotency,
            fault_hook: None,
            readiness,
        }
    }

    /// Replaces the clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.idempotency = self.idempotency.clock(clock);
        self
    }

    /// Installs a fault-injection hook.
    pub fn with_fault_hook(mut self, hook: FaultHook) -> Self {
        self.fault_hook = Some(hook);
        self
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn readiness(&self) -> &Arc<Readiness> {
        &self.readiness
    }

    /// The idempotency store the POST routes are layered with.
    pub fn idempotency(&self) -> &Idempotency {
        &self.idempotency
    }

    pub(crate) async fn hook(
        &self,
        stage: Stage,
        operation: Operation,
    ) -> Result<(), InjectedFault> {
        match &self.fault_hook {
            Some(hook) => hook(stage, operation).await,
            None => Ok(()),
        }
    }
}
