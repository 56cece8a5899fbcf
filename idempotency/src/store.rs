//! [`Idempotency`]: where the records live (pool, product schema) and their timing (TTL, lease,
//! clock). One per service, cheap to clone; [`Idempotency::route`] (in [`crate::layer`]) makes the
//! layer for one operation.

use chrono::{DateTime, SubsecRound, TimeDelta, Utc};
use shared::schema::Schema;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;

/// The clock every stored or compared time comes from (reservation, lease, expiry), never the
/// database's, so tests move time without sleeping.
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// Records of one service: the pool, the product schema (`outbox` by default) that holds
/// `idempotency_keys`, how long keys are kept, how long a processing lease lasts, and the clock.
#[derive(Clone)]
pub struct Idempotency {
    pub(crate) pool: PgPool,
    pub(crate) schema: Schema,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) clock: Clock,
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("schema", &self.schema)
            .field("ttl", &self.ttl)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl Idempotency {
    /// Defaults: schema `outbox`, TTL 24 h, lease 30 s, the system clock.
    pub fn new(pool: PgPool) -> Self {
        crate::internal_events::describe();
        Self {
            pool,
            schema: Schema::default(),
            ttl: Duration::from_secs(86_400),
            lease: Duration::from_secs(30),
            clock: Arc::new(Utc::now),
        }
    }

    /// The product schema whose `idempotency_keys` table holds the records.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// How long a key is kept; afterwards the same key counts as new and its record is purged.
    ///
    /// # Panics
    /// When `ttl` is under a second (records could not be stored).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        assert!(
            ttl >= Duration::from_secs(1),
            "the idempotency TTL must be at least 1 s, got {ttl:?}"
        );
        self.ttl = ttl;
        self
    }

    /// How long a processing record is held before a retry may take it over (its holder presumed
    /// dead). Longer than any request may take.
    ///
    /// # Panics
    /// When `lease` is under a second.
    pub fn lease(mut self, lease: Duration) -> Self {
        assert!(
            lease >= Duration::from_secs(1),
            "the idempotency lease must be at least 1 s, got {lease:?}"
        );
        self.lease = lease;
        self
    }

    /// Replaces the clock.
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The current time, truncated to microseconds (what PostgreSQL stores), so a response written
    /// from it equals what a later read returns.
    pub fn now(&self) -> DateTime<Utc> {
        (self.clock)().trunc_subsecs(6)
    }
}

/// `now + d`, saturating at the far future instead of overflowing.
pub(crate) fn add(now: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `now - d`, saturating at the far past.
pub(crate) fn sub(now: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}
