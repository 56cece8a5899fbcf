//! A [`Dependency`]: a named remote with its policy; [`Dependency::acquire`] asks the shared
//! circuit and limits whether a call may go now, and the [`Permit`] it gives records what the
//! call's answer said ([`Permit::record`]).
//!
//! The happy path costs no write: a closed circuit is read at most once per
//! [`Policy::cache_for`] per instance, and an answered call on a closed circuit changes nothing.
//! The concurrency cap and the rate limit cost one statement each per call, and only when the
//! policy has them.

use crate::circuit::{self, Admit, Circuit, Outcome, WaitReason};
use crate::error::DeclareError;
use crate::internal_events as events;
use crate::policy::Policy;
use crate::state::CircuitState;
use crate::store;
use chrono::{DateTime, Utc};
use shared::schema::Schema;
use sqlx::PgPool;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// A remote the application calls, shared by every step and handler that names it.
#[derive(Clone)]
pub struct Dependency {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    policy: Policy,
    /// The circuit as last read or written, and when (shared, not copied, by every call that
    /// reads it while it is fresh: the happy path's only cost).
    cache: Mutex<Option<(Instant, Arc<Circuit>)>>,
    /// The call counters by outcome, made on first use (after the metrics recorder is in).
    calls: std::sync::OnceLock<[metrics::Counter; 3]>,
    /// The row (and the slots) exist.
    ensured: AtomicBool,
    /// This process's holder id for concurrency slots.
    holder: Uuid,
}

impl std::fmt::Debug for Dependency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dependency")
            .field("name", &self.inner.name)
            .field("policy", &self.inner.policy)
            .finish()
    }
}

/// The answer of [`Dependency::acquire`].
#[derive(Debug)]
pub enum Admission {
    /// Call now; record the answer on the permit.
    Go(Permit),
    /// Do not call before `until`.
    Wait(Wait),
}

/// Why and until when a call waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    pub until: DateTime<Utc>,
    pub reason: WaitReason,
}

impl Wait {
    /// How long from now.
    pub fn remaining(&self) -> Duration {
        (self.until - Utc::now()).to_std().unwrap_or_default()
    }
}

/// Whether the name is one a dependency may have (1-100 of `A-Z a-z 0-9 . _ -`).
pub fn valid_name(name: &str) -> bool {
    (1..=100).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Dependency {
    /// A dependency named `name` (1-100 of `A-Z a-z 0-9 . _ -`) with `policy`; refused, with the
    /// rule, when either cannot work.
    pub fn new(name: &str, policy: Policy) -> Result<Self, DeclareError> {
        if !valid_name(name) {
            return Err(DeclareError::Name(name.to_string()));
        }
        policy.validate()?;
        events::describe();
        Ok(Self {
            inner: Arc::new(Inner {
                name: name.to_string(),
                policy,
                cache: Mutex::new(None),
                calls: std::sync::OnceLock::new(),
                ensured: AtomicBool::new(false),
                holder: Uuid::new_v4(),
            }),
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// Creates the dependency's row and slots, once per process.
    async fn ensure(&self, pool: &PgPool, schema: &Schema) -> Result<(), sqlx::Error> {
        if self.inner.ensured.load(Ordering::Relaxed) {
            return Ok(());
        }
        let p = &self.inner.policy;
        store::ensure(pool, schema, self.name(), p.rate.map(|r| r.burst)).await?;
        if let Some(cap) = p.concurrency {
            store::ensure_slots(pool, schema, self.name(), cap).await?;
        }
        self.inner.ensured.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// The shared circuit, read now (and cached).
    pub async fn circuit(&self, pool: &PgPool, schema: &Schema) -> Result<Circuit, sqlx::Error> {
        self.ensure(pool, schema).await?;
        let c = store::load(pool, schema, self.name())
            .await?
            .unwrap_or_default();
        self.remember(&c);
        Ok(c)
    }

    /// Reads the shared circuit and limits and sets their gauges (circuit state, how long open,
    /// concurrency slots held, tokens): for a worker's periodic statistics, so that the gauges
    /// say the truth between calls too.
    pub async fn report(&self, pool: &PgPool, schema: &Schema) -> Result<(), sqlx::Error> {
        self.circuit(pool, schema).await?;
        let usage = self.usage(pool, schema).await?;
        if let Some(cap) = self.inner.policy.concurrency {
            events::slots(self.name(), usage.slots_held, cap);
        }
        if let Some(t) = usage.tokens {
            events::tokens(self.name(), t);
        }
        Ok(())
    }

    /// The limits as they stand across all instances: slots held now, tokens in the bucket.
    pub async fn usage(&self, pool: &PgPool, schema: &Schema) -> Result<Usage, sqlx::Error> {
        self.ensure(pool, schema).await?;
        let rate = self.inner.policy.rate.map(|r| (r.per_second, r.burst));
        let (slots_held, tokens) = store::usage(pool, schema, self.name(), rate).await?;
        Ok(Usage { slots_held, tokens })
    }

    /// The circuit from the cache while it is fresh, else read.
    async fn cached(&self, pool: &PgPool, schema: &Schema) -> Result<Arc<Circuit>, sqlx::Error> {
        let fresh = {
            let cache = self.inner.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache
                .as_ref()
                .filter(|(at, _)| at.elapsed() < self.inner.policy.cache_for)
                .map(|(_, c)| c.clone())
        };
        match fresh {
            Some(c) => Ok(c),
            None => self.circuit(pool, schema).await.map(Arc::new),
        }
    }

    /// The circuit as this instance last read or wrote it (no database call).
    pub fn last_seen(&self) -> Option<Circuit> {
        let cache = self.inner.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.as_ref().map(|(_, c)| Circuit::clone(c))
    }

    fn remember(&self, c: &Circuit) {
        events::circuit(self.name(), c);
        let mut cache = self.inner.cache.lock().unwrap_or_else(|e| e.into_inner());
        *cache = Some((Instant::now(), Arc::new(c.clone())));
    }

    fn refuse(&self, until: DateTime<Utc>, reason: WaitReason) -> Admission {
        events::refused(self.name(), &reason);
        Admission::Wait(Wait { until, reason })
    }

    /// May a call go now? `probe_lease`: how long the call may take (its timeout and a margin):
    /// a probe holds the half-open circuit, and a concurrency slot is held, at most that long.
    pub async fn acquire(
        &self,
        pool: &PgPool,
        schema: &Schema,
        probe_lease: Duration,
    ) -> Result<Admission, sqlx::Error> {
        let c = self.cached(pool, schema).await?;
        let now = Utc::now();
        let (first, _) = circuit::admit(&c, now, probe_lease);
        if let Admit::Wait { until, reason } = first {
            return Ok(self.refuse(until, reason));
        }
        let p = self.inner.policy;
        let slot = match p.concurrency {
            None => None,
            Some(_) => {
                let holder = self.inner.holder;
                match store::take_slot(pool, schema, self.name(), holder, probe_lease).await? {
                    Some(s) => Some(s),
                    None => {
                        let until = circuit::after(now, jitter(Duration::from_millis(100)));
                        return Ok(self.refuse(until, WaitReason::Saturated));
                    }
                }
            }
        };
        let mut permit = Permit {
            dependency: self.clone(),
            pool: pool.clone(),
            schema: schema.clone(),
            slot,
            probe: false,
        };
        if let Some(r) = p.rate {
            match store::take_token(pool, schema, self.name(), r.per_second, r.burst).await? {
                Ok(left) => events::tokens(self.name(), left),
                Err(wait) => {
                    permit.release().await;
                    events::tokens(self.name(), 0.0);
                    return Ok(self.refuse(circuit::after(now, wait), WaitReason::RateLimited));
                }
            }
        }
        if first == (Admit::Go { probe: true }) {
            match self.take_probe(pool, schema, probe_lease).await? {
                Ok(probe) => permit.probe = probe,
                Err((until, reason)) => {
                    permit.release().await;
                    return Ok(self.refuse(until, reason));
                }
            }
        }
        Ok(Admission::Go(permit))
    }

    /// Takes the probe on the stored circuit (compare-and-set): `Ok(true)` this call probes,
    /// `Ok(false)` the circuit closed meanwhile, `Err` another caller took it.
    async fn take_probe(
        &self,
        pool: &PgPool,
        schema: &Schema,
        lease: Duration,
    ) -> Result<Result<bool, (DateTime<Utc>, WaitReason)>, sqlx::Error> {
        for _ in 0..3 {
            let c = self.circuit(pool, schema).await?;
            let now = Utc::now();
            match circuit::admit(&c, now, lease) {
                (Admit::Wait { until, reason }, _) => return Ok(Err((until, reason))),
                (Admit::Go { probe: false }, _) => return Ok(Ok(false)),
                (Admit::Go { probe: true }, Some(next)) => {
                    if store::compare_and_set(pool, schema, self.name(), &next).await? {
                        let stored = Circuit {
                            version: next.version + 1,
                            ..next
                        };
                        events::transition(self.name(), stored.state);
                        tracing::info!(dependency = %self.name(), "circuit half open: probing the remote");
                        self.remember(&stored);
                        return Ok(Ok(true));
                    }
                }
                (Admit::Go { probe: true }, None) => return Ok(Ok(true)),
            }
        }
        let until = circuit::after(Utc::now(), jitter(Duration::from_millis(500)));
        Ok(Err((until, WaitReason::Probing { since: None })))
    }

    /// How much waiting work to wake now, oldest first: the policy's resume rate while the
    /// circuit is closed, one (the next probe) when an open circuit's cool-down is over or a
    /// probe's lease ran out, none otherwise. At most one caller a second across all instances
    /// gets a non-zero answer, so the rate holds however many instances ask.
    pub async fn resume_budget(&self, pool: &PgPool, schema: &Schema) -> Result<u32, sqlx::Error> {
        let c = self.circuit(pool, schema).await?;
        let now = Utc::now();
        let budget = match circuit::admit(&c, now, Duration::ZERO).0 {
            Admit::Go { probe: false } => self.inner.policy.resume_per_second,
            Admit::Go { probe: true } => 1,
            Admit::Wait { .. } => 0,
        };
        if budget == 0 || !store::take_resume_turn(pool, schema, self.name()).await? {
            return Ok(0);
        }
        Ok(budget)
    }

    /// Records `outcome` of a call made with (`probe`) or without the probe.
    async fn record(
        &self,
        pool: &PgPool,
        schema: &Schema,
        outcome: &Outcome,
        probe: bool,
    ) -> Result<(), sqlx::Error> {
        let calls = self
            .inner
            .calls
            .get_or_init(|| events::call_counters(self.name()));
        calls[match outcome {
            Outcome::Answered => 0,
            Outcome::Unavailable { .. } => 1,
            Outcome::NoAnswer => 2,
        }]
        .increment(1);
        let policy = self.inner.policy;
        let quiet = *outcome == Outcome::Answered && !probe && policy.failure_rate.is_none();
        for attempt in 0..5 {
            let c = if quiet && attempt == 0 {
                self.cached(pool, schema).await?
            } else {
                Arc::new(self.circuit(pool, schema).await?)
            };
            let Some(next) = circuit::record(&c, outcome, probe, &policy, Utc::now()) else {
                return Ok(());
            };
            if store::compare_and_set(pool, schema, self.name(), &next).await? {
                let stored = Circuit {
                    version: next.version + 1,
                    ..next
                };
                if stored.state != c.state {
                    events::transition(self.name(), stored.state);
                    log_transition(self.name(), &c, &stored);
                }
                self.remember(&stored);
                return Ok(());
            }
        }
        tracing::debug!(dependency = %self.name(), "circuit not updated: five writers in a row were faster");
        Ok(())
    }
}

fn log_transition(name: &str, before: &Circuit, after: &Circuit) {
    match after.state {
        CircuitState::Open if before.state == CircuitState::Closed => tracing::warn!(
            dependency = %name,
            error = after.last_error.as_deref().unwrap_or(""),
            "circuit opened: {}", after.reason
        ),
        CircuitState::Open => {
            tracing::info!(dependency = %name, "circuit stays open: {}", after.reason)
        }
        CircuitState::Closed => tracing::info!(
            dependency = %name,
            down_for = ?before.down_since.and_then(|t| (Utc::now() - t).to_std().ok()),
            "circuit closed: {}", after.reason
        ),
        CircuitState::HalfOpen => {}
    }
}

/// A dependency's limits as they stand ([`Dependency::usage`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Concurrency slots held now (not expired), across all instances.
    pub slots_held: i64,
    /// Tokens in the rate limit's bucket now; `None` without a rate limit.
    pub tokens: Option<f64>,
}

/// What a call may do now that the circuit let it go. Record its answer with
/// [`Permit::record`]; a permit dropped unrecorded gives its concurrency slot back only when the
/// slot's lease ends, and a probe's circuit stays half open until its lease ends.
#[derive(Debug)]
pub struct Permit {
    dependency: Dependency,
    pool: PgPool,
    schema: Schema,
    slot: Option<i32>,
    probe: bool,
}

impl Permit {
    /// This call decides whether the circuit closes.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    pub fn dependency(&self) -> &Dependency {
        &self.dependency
    }

    async fn release(&mut self) {
        if let Some(slot) = self.slot.take() {
            let d = &self.dependency;
            if let Err(e) =
                store::release_slot(&self.pool, &self.schema, d.name(), slot, d.inner.holder).await
            {
                tracing::debug!(dependency = %d.name(), error = %e, "slot not released; it comes back when its lease ends");
            }
        }
    }

    /// The call was not made after all: the slot goes back, nothing is recorded (a probe's
    /// circuit stays half open until the probe's lease ends, then another caller probes).
    pub async fn cancel(mut self) {
        self.release().await;
    }

    /// Records what the call's answer said of the remote's health, and gives the slot back. A
    /// database error here is logged, not returned: the call's own outcome is what matters to the
    /// caller, and the circuit learns from the next call.
    pub async fn record(mut self, outcome: Outcome) {
        self.release().await;
        let d = self.dependency.clone();
        if let Err(e) = d
            .record(&self.pool, &self.schema, &outcome, self.probe)
            .await
        {
            tracing::warn!(dependency = %d.name(), error = %e, "the call's answer was not recorded in the circuit");
        }
    }
}

/// `d` to `2d`, so waiters do not come back in step.
fn jitter(d: Duration) -> Duration {
    use rand::Rng;
    d + d.mul_f64(rand::rng().random_range(0.0..1.0))
}
