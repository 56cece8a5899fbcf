//! The state every handler shares: the pool, the settings, the clock and the fault-injection hook.

use crate::config::Settings;
use crate::idempotency::Operation;
use chrono::{DateTime, SubsecRound, TimeDelta, Utc};
use futures::future::BoxFuture;
use plumbing::telemetry::Readiness;
use sqlx::PgPool;
use std::sync::{Arc, Mutex};

/// The application clock. Every time the producer stores or compares (reservation, lease, expiry,
/// created_at) comes from it, never from the database, so tests move time without sleeping.
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

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

/// Points of a POST where the fault hook is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The key is reserved (record `processing`), the effect transaction has not started.
    Reserved,
    /// The effect transaction wrote everything (business rows, outbox event, final record) and is
    /// about to commit.
    BeforeCommit,
}

/// A failure injected by the fault hook; handled like a database error at that point.
#[derive(Debug, Clone, thiserror::Error)]
#[error("injected fault: {0}")]
pub struct InjectedFault(pub String);

/// Fault injection for tests: called at every [`Stage`] of every POST. It may return an error,
/// panic, or wait (to hold a request in `processing`).
pub type FaultHook =
    Arc<dyn Fn(Stage, Operation) -> BoxFuture<'static, Result<(), InjectedFault>> + Send + Sync>;

/// Shared state of the router: cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) pool: PgPool,
    pub(crate) settings: Settings,
    pub(crate) clock: Clock,
    pub(crate) fault_hook: Option<FaultHook>,
    pub(crate) readiness: Arc<Readiness>,
}

impl AppState {
    /// State over a connected pool whose schema is migrated, with the system clock and no hook.
    pub fn new(pool: PgPool, settings: Settings) -> Self {
        let readiness = Readiness::without_rabbitmq();
        readiness.set_postgres(true);
        Self {
            pool,
            settings,
            clock: system_clock(),
            fault_hook: None,
            readiness,
        }
    }

    /// Replaces the clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
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

    /// The current time, truncated to microseconds (what PostgreSQL stores), so a response written
    /// from it equals what a later GET reads back.
    pub fn now(&self) -> DateTime<Utc> {
        (self.clock)().trunc_subsecs(6)
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

/// `now + d`, saturating at the far future instead of overflowing.
pub(crate) fn add(now: DateTime<Utc>, d: std::time::Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `now - d`, saturating at the far past.
pub(crate) fn sub(now: DateTime<Utc>, d: std::time::Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}
