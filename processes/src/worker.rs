//! The worker: claims due processes with `FOR UPDATE SKIP LOCKED` and a lease, runs each claimed
//! process in its own task, wakes on NOTIFY (channel `<schema>.processes`) with a fallback poll.
//!
//! A killed worker's processes are taken over by any other worker once their lease expires
//! (`lease`, so the bound is `lease + poll`). On shutdown the worker stops claiming, lets each
//! process finish its current step and releases it; after `shutdown_grace`, calls still in flight
//! are abandoned (their outcome stays unknown and is resolved by the next owner) and the lease is
//! released.

use crate::claim_floor::ClaimFloor;
use crate::definition::Registry;
use crate::fair::{FairShare, Passes};
use crate::internal_events as events;
use crate::runner::{self, Shared, Spare, TurnEnd};
use crate::start::notify_channel;
use crate::store::{self, Claimed};
use shared::schema::Schema;
use sqlx::{PgPool, Row};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Needs about `concurrency + 3` connections (the claim, heartbeats; the listener has its own).
    /// While it has work, the worker hands connections from a finished process to the next one
    /// instead of returning them to the pool (each return and acquire costs sqlx a ping); it
    /// returns them all when a claim finds nothing due.
    pub pool: PgPool,
    pub schema: Schema,
    /// Unique per worker process (shown as the lease owner).
    pub worker_id: String,
    /// Processes worked on at once.
    pub concurrency: usize,
    /// How long a claim holds; a dead worker's processes are taken over after it.
    pub lease: Duration,
    /// How often a held lease is extended (well under `lease`).
    pub heartbeat: Duration,
    /// Fallback poll when no NOTIFY arrives (retries that became due, missed notifications).
    pub poll_interval: Duration,
    /// Most processes claimed by one statement.
    pub claim_batch: i64,
    /// Most consecutive local steps of one process run in one transaction (effects, then one
    /// fenced checkpoint of them all, one commit). 1 commits every local step on its own. A crash
    /// rolls back the whole group (none of its effects commit, the next owner runs it again), and
    /// the group's row locks are held until its commit.
    pub local_steps_per_transaction: usize,
    /// On shutdown, how long a call in flight may still finish before it is abandoned.
    pub shutdown_grace: Duration,
    /// How often the worker refreshes the status gauges and looks for unknown versions.
    pub stats_interval: Duration,
    /// Told after every claim whether the database answered, so a binary's `/readyz` follows it.
    pub on_database: Option<DatabaseHook>,
    /// Claim by weighted fair share of the definitions' fair keys ([`crate::fair`]) instead of
    /// strictly oldest first. `None` (the default): oldest first.
    pub fair_share: Option<FairShare>,
}

/// Called with `true` after a claim the database answered, `false` after one that failed.
#[derive(Clone)]
pub struct DatabaseHook(pub Arc<dyn Fn(bool) + Send + Sync>);

impl std::fmt::Debug for DatabaseHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DatabaseHook")
    }
}

impl WorkerConfig {
    pub fn new(pool: PgPool, schema: Schema, worker_id: impl Into<String>) -> Self {
        Self {
            pool,
            schema,
            worker_id: worker_id.into(),
            concurrency: 16,
            lease: Duration::from_secs(15),
            heartbeat: Duration::from_secs(5),
            poll_interval: Duration::from_millis(500),
            claim_batch: 32,
            local_steps_per_transaction: 8,
            shutdown_grace: Duration::from_secs(10),
            stats_interval: Duration::from_secs(5),
            on_database: None,
            fair_share: None,
        }
    }
}

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("the registry has no definitions")]
    EmptyRegistry,
    #[error("worker configuration: {0}")]
    Config(String),
}

/// The worker.
pub struct Worker;

impl Worker {
    /// Runs until `shutdown` is cancelled; then finishes or abandons the current steps safely.
    pub async fn run(
        config: WorkerConfig,
        registry: Registry,
        shutdown: CancellationToken,
    ) -> Result<(), WorkerError> {
        check(&config, &registry)?;
        events::describe();
        let (kinds, versions) = registry.known();
        let shared = Shared {
            pool: config.pool.clone(),
            breaker_pool: sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect_lazy_with(config.pool.connect_options().as_ref().clone()),
            lease: config.lease,
            heartbeat: config.heartbeat,
            local_group: config.local_steps_per_transaction,
            spare: Spare::new(config.concurrency),
        };
        let wake = Arc::new(Notify::new());
        let background = CancellationToken::new();
        // The listener gets a pool of its own, so a dropped listener never holds up closing the
        // caller's pool.
        let listener = tokio::spawn(plumbing::listen::wake_on_notify(
            plumbing::listen::ListenOn::own_pool(&config.pool),
            notify_channel(&config.schema),
            wake.clone(),
            background.clone(),
        ));
        let dependencies = registry.dependencies();
        let resume = tokio::spawn(resume_waiting(
            config.clone(),
            dependencies.clone(),
            wake.clone(),
            background.clone(),
        ));
        let stats = Stats {
            config: config.clone(),
            kinds: kinds.clone(),
            versions: versions.clone(),
            dependencies: dependencies.clone(),
            seen: HashSet::new(),
            warned: HashSet::new(),
        };
        let (interval, stop) = (config.stats_interval, background.clone());
        let stats = tokio::spawn(async move {
            plumbing::periodic::every(interval, &stop, stats).await;
        });
        tracing::info!(worker = %config.worker_id, "process worker started");
        let mut turns = Turns {
            config: &config,
            registry: Arc::new(registry),
            shared,
            kinds,
            versions,
            running: JoinSet::new(),
            abandon: CancellationToken::new(),
            failures: 0,
            database_up: None,
            passes: Passes::default(),
            floor: ClaimFloor::default(),
        };
        turns.claim_until(&shutdown, &wake).await;
        turns.finish().await;
        background.cancel();
        let _ = listener.await;
        let _ = stats.await;
        let _ = resume.await;
        turns.shared.breaker_pool.close().await;
        tracing::info!(worker = %config.worker_id, "process worker stopped");
        Ok(())
    }
}

/// A configuration the worker cannot run with.
fn check(config: &WorkerConfig, registry: &Registry) -> Result<(), WorkerError> {
    if registry.is_empty() {
        return Err(WorkerError::EmptyRegistry);
    }
    if config.heartbeat >= config.lease
        || config.concurrency == 0
        || config.claim_batch < 1
        || config.local_steps_per_transaction == 0
    {
        return Err(WorkerError::Config(
            "heartbeat must be shorter than the lease; concurrency, claim_batch and local_steps_per_transaction at least 1"
                .into(),
        ));
    }
    if let Some(share) = &config.fair_share {
        share
            .check()
            .map_err(|e| WorkerError::Config(format!("fair share: {e}")))?;
    }
    Ok(())
}

/// The worker's claims and the turns they started, one task per claimed process.
struct Turns<'a> {
    config: &'a WorkerConfig,
    registry: Arc<Registry>,
    shared: Shared,
    kinds: Vec<String>,
    versions: Vec<i32>,
    running: JoinSet<()>,
    /// Cancelled when the shutdown's grace is over: calls still in flight are abandoned.
    abandon: CancellationToken,
    /// Claims failed in a row (the backoff grows with them).
    failures: u32,
    /// What the hook was last told ([`report_database`]).
    database_up: Option<bool>,
    /// Where each fair key stands (with a fair share).
    passes: Passes,
    /// Where the next claim starts reading the due index.
    floor: ClaimFloor,
}

impl Turns<'_> {
    /// Claims and starts turns until `shutdown`: at once again while claims come back full,
    /// otherwise on a NOTIFY, the poll, or a finished turn.
    async fn claim_until(&mut self, shutdown: &CancellationToken, wake: &Notify) {
        let config = self.config;
        // A finished process frees one slot; claiming for each would cost a claim per process
        // under load. Slots freed by finished processes are claimed for once a quarter of a batch
        // is free (or nothing runs); a NOTIFY or the poll claims for any free slot.
        let refill = (config.concurrency.min(config.claim_batch as usize) / 4).max(1);
        let mut woke_by_finish = false;
        while !shutdown.is_cancelled() {
            let free = config.concurrency.saturating_sub(self.running.len());
            let mut full = false;
            if free > 0 && (!woke_by_finish || free >= refill || self.running.is_empty()) {
                full = self.claim_and_start(free, shutdown).await;
            }
            if full && self.failures == 0 {
                // More may be due right now; still let finished tasks be reaped.
                while self.running.try_join_next().is_some() {}
                continue;
            }
            let idle = if self.failures > 0 {
                config
                    .poll_interval
                    .max(Duration::from_millis(200) * self.failures.min(10))
            } else {
                config.poll_interval
            };
            woke_by_finish = false;
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(idle) => {}
                Some(_) = self.running.join_next(), if !self.running.is_empty() => {
                    while self.running.try_join_next().is_some() {}
                    woke_by_finish = true;
                }
                _ = shutdown.cancelled() => {}
            }
        }
    }

    /// Claims up to `free` processes (at most a batch) and starts a turn for each; true if the
    /// claim came back full (more may be due).
    async fn claim_and_start(&mut self, free: usize, shutdown: &CancellationToken) -> bool {
        let config = self.config;
        let limit = (free as i64).min(config.claim_batch);
        let claimed = match self.shared.spare.take(&config.pool).await {
            Ok(mut conn) => {
                let claimed = match &config.fair_share {
                    None => {
                        let now = Instant::now();
                        let from = self.floor.start(now);
                        store::claim(
                            &mut conn,
                            &config.schema,
                            &self.kinds,
                            &self.versions,
                            limit,
                            &config.worker_id,
                            config.lease,
                            from,
                        )
                        .await
                        .map(|(claimed, oldest)| {
                            self.floor.claimed(now, from, oldest);
                            claimed
                        })
                    }
                    Some(share) => {
                        store::claim_fair(
                            &mut conn,
                            &config.schema,
                            &self.kinds,
                            &self.versions,
                            limit,
                            &config.worker_id,
                            config.lease,
                            share,
                            &mut self.passes,
                        )
                        .await
                    }
                };
                if claimed.is_ok() {
                    self.shared.spare.give(conn);
                }
                claimed
            }
            Err(e) => Err(e),
        };
        match claimed {
            Ok(claimed) => {
                report_database(config, &mut self.database_up, true);
                self.failures = 0;
                let full = claimed.len() as i64 == limit;
                if claimed.is_empty() {
                    // Nothing due: an idle worker holds no connections.
                    self.shared.spare.clear();
                }
                for c in claimed {
                    self.start(c, shutdown);
                }
                full
            }
            Err(e) => {
                self.failures += 1;
                self.floor.reset();
                report_database(config, &mut self.database_up, false);
                self.shared.spare.clear();
                tracing::warn!(error = %e, "claim failed; retrying");
                false
            }
        }
    }

    /// Starts the turn of claimed process `c` in a task of its own.
    fn start(&mut self, c: Claimed, shutdown: &CancellationToken) {
        events::claimed(&c.kind, c.previous_owner.is_some());
        if let Some(prev) = &c.previous_owner {
            tracing::info!(process = %c.id(), previous = %prev, token = c.lease.token(), "took over an expired lease");
        }
        let Some(def) = self.registry.get(&c.kind, c.version).cloned() else {
            return; // the claim filters by known versions
        };
        let sh = self.shared.clone();
        let stop = shutdown.clone();
        let abandon = self.abandon.clone();
        self.running.spawn(async move {
            let id = c.id();
            match runner::run(&sh, def, c, stop, abandon).await {
                Ok(TurnEnd::Fenced) => {
                    tracing::warn!(process = %id, "lease lost: this worker's remaining writes were fenced off");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(process = %id, error = %e, "database error while running a process; its lease will expire and another claim resumes it");
                }
            }
        });
    }

    /// After shutdown: lets each turn finish its current step; after the grace, abandons the
    /// calls still in flight (their turns release their leases).
    async fn finish(&mut self) {
        let config = self.config;
        tracing::info!(worker = %config.worker_id, in_flight = self.running.len(), "stopping: finishing current steps");
        let grace = tokio::time::sleep(config.shutdown_grace);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                r = self.running.join_next() => if r.is_none() { break },
                _ = &mut grace, if !self.abandon.is_cancelled() => self.abandon.cancel(),
            }
        }
        self.shared.spare.clear();
    }
}

/// Tells the hook when the database's answer to claims changed (not after every claim).
fn report_database(config: &WorkerConfig, last: &mut Option<bool>, up: bool) {
    if *last != Some(up) {
        *last = Some(up);
        if let Some(hook) = &config.on_database {
            (hook.0)(up);
        }
    }
}

/// Refreshes the status gauges and the manual-review backlog, and says (metric and log) when due
/// processes wait for a definition version this worker does not have; every
/// `config.stats_interval`, through [`plumbing::periodic`].
struct Stats {
    config: WorkerConfig,
    kinds: Vec<String>,
    versions: Vec<i32>,
    /// The dependencies the registry's steps name (their waiting gauges, their circuits' and
    /// limits' gauges).
    dependencies: Vec<breaker::Dependency>,
    /// The (kind, status) gauges set last time, to zero those that are gone.
    seen: HashSet<(String, String)>,
    /// The unknown versions already logged, to log each once.
    warned: HashSet<(String, i32)>,
}

impl plumbing::periodic::Refresh for Stats {
    async fn refresh(&mut self) {
        let Stats {
            config,
            kinds,
            versions,
            dependencies,
            seen,
            warned,
        } = self;
        if let Err(e) = refresh_waiting(config, dependencies).await {
            tracing::debug!(error = %e, "waiting gauges not refreshed");
        }
        for dep in dependencies.iter() {
            if let Err(e) = dep.report(&config.pool, &config.schema).await {
                tracing::debug!(dependency = %dep.name(), error = %e, "dependency gauges not refreshed");
            }
        }
        if let Err(e) = refresh(config, kinds, versions, seen, warned).await {
            tracing::debug!(error = %e, "process statistics not refreshed");
        }
    }
}

async fn refresh(
    config: &WorkerConfig,
    kinds: &[String],
    versions: &[i32],
    seen: &mut HashSet<(String, String)>,
    warned: &mut HashSet<(String, i32)>,
) -> Result<(), sqlx::Error> {
    let rows = sqlx::query(config.schema.sql(
        "SELECT kind, status, count(*) AS n FROM {{schema}}.processes \
         WHERE status IN ('pending', 'running', 'waiting', 'compensating', 'manual_review') GROUP BY 1, 2",
    ))
    .fetch_all(&config.pool)
    .await?;
    let mut now_seen = HashSet::new();
    for r in &rows {
        let kind: String = r.try_get("kind")?;
        let status: String = r.try_get("status")?;
        let n: i64 = r.try_get("n")?;
        events::active(&kind, &status, n);
        now_seen.insert((kind, status));
    }
    for (kind, status) in seen.difference(&now_seen) {
        events::active(kind, status, 0);
    }
    *seen = now_seen;
    // The console's tile reads the same figure (one definition: since the process went into
    // manual review, not since its row last changed).
    let review = crate::look::review_backlog(&config.pool, &config.schema).await?;
    let age = review
        .oldest_since
        .map(|t| (chrono::Utc::now() - t).to_std().unwrap_or_default())
        .unwrap_or_default();
    events::manual_review(review.count, age);
    for (kind, version, n) in
        store::unknown_versions(&config.pool, &config.schema, kinds, versions).await?
    {
        events::unknown_version(&kind, version, n);
        if warned.insert((kind.clone(), version)) {
            tracing::warn!(kind = %kind, version, due = n, "due processes of a definition version this worker does not have; leaving them to a worker that has it");
        }
    }
    Ok(())
}

/// Sets the gauges of the steps waiting for each dependency the registry names.
async fn refresh_waiting(
    config: &WorkerConfig,
    dependencies: &[breaker::Dependency],
) -> Result<(), sqlx::Error> {
    if dependencies.is_empty() {
        return Ok(());
    }
    let rows = store::waiting_by_dependency(&config.pool, &config.schema).await?;
    let now = chrono::Utc::now();
    for name in dependencies.iter().map(|d| d.name()) {
        let (n, oldest) = rows
            .iter()
            .find(|(d, _, _)| d == name)
            .map(|(_, n, since)| {
                let age = since.and_then(|t| (now - t).to_std().ok());
                (*n, age.unwrap_or_default())
            })
            .unwrap_or_default();
        events::waiting(name, n, oldest);
    }
    Ok(())
}

/// How often the wake-up looks at the dependencies' circuits.
const RESUME_TICK: Duration = Duration::from_millis(250);

/// The wake-up: while steps wait for a dependency, wakes them when its circuit lets calls go
/// again, the longest-waiting first and at most the policy's resume rate a second across all
/// workers ([`breaker::Dependency::resume_budget`]); while the circuit is open, wakes one step
/// as the probe when the cool-down is over. So a recovery is no thundering herd, and an open
/// circuit costs the remote one call per cool-down.
async fn resume_waiting(
    config: WorkerConfig,
    dependencies: Vec<breaker::Dependency>,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    if dependencies.is_empty() {
        return;
    }
    loop {
        for dep in &dependencies {
            match resume_one(&config, dep).await {
                Ok(0) => {}
                Ok(n) => {
                    tracing::debug!(dependency = %dep.name(), woken = n, "woke steps waiting for their dependency");
                    wake.notify_one();
                }
                Err(e) => {
                    tracing::debug!(dependency = %dep.name(), error = %e, "wake-up of waiting steps failed; trying again");
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RESUME_TICK) => {}
            _ = stop.cancelled() => return,
        }
    }
}

async fn resume_one(config: &WorkerConfig, dep: &breaker::Dependency) -> Result<u64, sqlx::Error> {
    if !store::any_waiting(&config.pool, &config.schema, dep.name()).await? {
        return Ok(0);
    }
    let budget = dep.resume_budget(&config.pool, &config.schema).await?;
    if budget == 0 {
        return Ok(0);
    }
    store::wake_waiting(&config.pool, &config.schema, dep.name(), budget).await
}
