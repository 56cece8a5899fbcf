//! Runs one claimed process until it finishes, waits, needs a person, or the lease is lost.
//!
//! The worker holds the lease for the whole turn (heartbeats extend it during long calls) and
//! runs steps in order. A local step's effect and checkpoint commit in one transaction, whose
//! checkpoint statement takes the fence; consecutive local steps share that transaction and that
//! statement (a *local group*, [`Run::run_local`]).
//! An external step commits its attempt first, then calls; if the previous attempt's outcome is
//! unknown (its worker died mid-call, or it timed out) what happens depends on the remote:
//! same key again, a status query first, or manual review. Nothing is ever marked done
//! without the evidence the remote or the local transaction gave. A step that names a dependency
//! asks its shared circuit first; one whose remote is unavailable waits without spending an
//! attempt ([`dependency`]).

mod dependency;

use dependency::{Unavailable, circuit_stopped, health, health_of_unavailable};

use crate::decide::{self, AfterError, Next, Phase, Undo};
use crate::definition::{
    Action, Definition, Done, ExternalStep, LocalStep, Lookup, Remote, Role, StepContext,
    TimerStep, WaitStep,
};
use crate::error::{ErrorClass, StepError};
use crate::internal_events as events;
use crate::redact;
use crate::retry::RetryPolicy;
use crate::status::{ProcessStatus, StepStatus};
use crate::store::{self, Claimed, Fenced, ProcessChange, StepChange, StepRow, WriteError};
use breaker::{Dependency, Outcome as Health, Permit};
use chrono::Utc;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgPool, Postgres};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A local step's action with its retry policy and timeout.
type LocalAction = (Arc<dyn LocalStep>, RetryPolicy, Duration);

/// What a remote's call answered: its result, or the timeout elapsed.
type CallOutcome = Result<Result<Done, StepError>, tokio::time::error::Elapsed>;

/// A wait step past its first look for the event: what its definition says, and its key.
struct Wait {
    remote: Remote,
    deadline: Duration,
    wait: Arc<dyn WaitStep>,
    retry: RetryPolicy,
    timeout: Duration,
    started: Instant,
    key: String,
}

/// An external step being run: what its definition says, and what the turn found.
struct External {
    remote: Remote,
    call: Arc<dyn ExternalStep>,
    retry: RetryPolicy,
    timeout: Duration,
    /// When the step's turn began (its attempt's latency is measured from here).
    started: Instant,
    /// The previous attempt may have acted ([`decide::in_doubt`]).
    doubt: bool,
    /// The remote's shared circuit and limits ([`crate::Step::needs`]), if it names one.
    dependency: Option<Dependency>,
}

/// What the worker shares with every run.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub pool: PgPool,
    /// The dependencies' bookkeeping (circuit reads and writes, slots, tokens): a pool of its own,
    /// two connections made when first used, so a turn that holds its connection never waits for
    /// one the other turns hold to ask a circuit.
    pub breaker_pool: PgPool,
    /// Connections of turns that ended, for the next turns while the worker has work.
    pub spare: Spare,
    pub lease: Duration,
    pub heartbeat: Duration,
    /// Most consecutive local steps of one process run in one transaction.
    pub local_group: usize,
}

/// How a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TurnEnd {
    /// succeeded, failed, compensated.
    Finished,
    /// Waiting (backoff) or in manual review: the lease is released.
    Parked,
    /// Shutdown: the lease is released at a safe point.
    Released,
    /// The lease was taken over: nothing more was written.
    Fenced,
}

/// Connections handed from a turn that ended to the next one while the worker has work, so a
/// process does not cost a pool acquire and release (sqlx pings the server on both). The worker
/// empties it whenever a claim finds nothing due (and on shutdown): an idle worker holds nothing.
/// A turn gives its connection back to the pool before an external call (it may be long; the
/// heartbeats need pool connections meanwhile) and drops it after a database error.
#[derive(Debug, Clone, Default)]
pub(crate) struct Spare {
    conns: Arc<std::sync::Mutex<Vec<PoolConnection<Postgres>>>>,
    cap: usize,
}

impl Spare {
    pub fn new(cap: usize) -> Self {
        Self {
            conns: Arc::default(),
            cap,
        }
    }

    /// A spare connection, or one from the pool.
    pub async fn take(&self, pool: &PgPool) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        let spare = self.conns.lock().ok().and_then(|mut v| v.pop());
        match spare {
            Some(c) => Ok(c),
            None => pool.acquire().await,
        }
    }

    /// Keeps `conn` for the next turn (or returns it to the pool when there are enough).
    pub fn give(&self, conn: PoolConnection<Postgres>) {
        if let Ok(mut v) = self.conns.lock()
            && v.len() < self.cap
        {
            v.push(conn);
        }
    }

    /// Returns every spare connection to the pool.
    pub fn clear(&self) {
        let drained: Vec<_> = self
            .conns
            .lock()
            .map(|mut v| v.drain(..).collect())
            .unwrap_or_default();
        drop(drained);
    }
}

struct Run<'a> {
    sh: &'a Shared,
    /// The turn's connection (taken when first needed).
    conn: Option<PoolConnection<Postgres>>,
    def: &'a Definition,
    c: Claimed,
    steps: Vec<StepRow>,
    phase: Phase,
    lost: CancellationToken,
    /// After step k of a local group starting at step `.0` failed: the next group there has `.1`
    /// (= k) steps.
    group_cap: Option<(usize, usize)>,
    /// The current external call's permit from its dependency, until its answer is recorded.
    permit: Option<Permit>,
}

/// Runs `c` (claimed with its token) with `def`. `stop` ends the turn at the next safe point;
/// `abandon` also interrupts an external call in flight (its outcome then stays unknown).
pub(crate) async fn run(
    sh: &Shared,
    def: Arc<Definition>,
    c: Claimed,
    stop: CancellationToken,
    abandon: CancellationToken,
) -> Result<TurnEnd, sqlx::Error> {
    let lost = CancellationToken::new();
    let beat_done = CancellationToken::new();
    let beat = tokio::spawn(heartbeat(
        sh.clone(),
        c.lease.clone(),
        c.kind.clone(),
        lost.clone(),
        beat_done.clone(),
    ));
    let phase = Phase::of(c.status);
    let mut c = c;
    let steps = std::mem::take(&mut c.steps);
    let mut r = Run {
        sh,
        conn: None,
        def: &def,
        c,
        steps,
        phase,
        lost,
        group_cap: None,
        permit: None,
    };
    let result = r.turn(&stop, &abandon).await;
    if let Some(p) = r.permit.take() {
        p.cancel().await;
    }
    // A connection that saw a database error goes back to the pool, which tests it.
    if let (Ok(_) | Err(WriteError::Fenced(_)), Some(conn)) = (&result, r.conn.take()) {
        sh.spare.give(conn);
    }
    beat_done.cancel();
    let _ = beat.await;
    match result {
        Ok(end) => Ok(end),
        Err(WriteError::Fenced(Fenced)) => Ok(TurnEnd::Fenced),
        Err(WriteError::Database(e)) => Err(e),
    }
}

async fn heartbeat(
    sh: Shared,
    lease: store::Lease,
    kind: String,
    lost: CancellationToken,
    done: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(sh.heartbeat) => {}
            _ = done.cancelled() => return,
        }
        match lease.heartbeat(&sh.pool, sh.lease).await {
            Ok(()) => {}
            Err(WriteError::Fenced(_)) => {
                events::fenced(&kind);
                tracing::warn!(process = %lease.id(), token = lease.token(), "heartbeat fenced: the lease was taken over; abandoning the process");
                lost.cancel();
                return;
            }
            Err(WriteError::Database(e)) => {
                tracing::warn!(process = %lease.id(), error = %e, "heartbeat failed; retrying");
            }
        }
    }
}

impl Run<'_> {
    /// The turn's connection, taken out (give it back with [`Self::put`]).
    async fn take(&mut self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        match self.conn.take() {
            Some(c) => Ok(c),
            None => self.sh.spare.take(&self.sh.pool).await,
        }
    }

    fn put(&mut self, conn: PoolConnection<Postgres>) {
        self.conn = Some(conn);
    }

    async fn turn(
        &mut self,
        stop: &CancellationToken,
        abandon: &CancellationToken,
    ) -> Result<TurnEnd, WriteError> {
        loop {
            if self.lost.is_cancelled() {
                return Err(Fenced.into());
            }
            if stop.is_cancelled() {
                self.process_change(ProcessChange::Release, "released at shutdown")
                    .await?;
                return Ok(TurnEnd::Released);
            }
            match self.next() {
                Next::Finish(change, reason) => {
                    self.process_change(change, &reason).await?;
                    self.finished(change);
                    return Ok(if matches!(change, ProcessChange::ManualReview) {
                        TurnEnd::Parked
                    } else {
                        TurnEnd::Finished
                    });
                }
                Next::Wait(at) => {
                    self.process_change(
                        ProcessChange::WaitUntil(at),
                        "backing off until the next attempt is due",
                    )
                    .await?;
                    return Ok(TurnEnd::Parked);
                }
                Next::Review(i, reason) => {
                    self.review(i, None, None, false, &reason).await?;
                    return Ok(TurnEnd::Parked);
                }
                Next::Compensate(reason) => {
                    let mut conn = self.take().await?;
                    let mut tx = conn.begin().await?;
                    self.c.lease.fence(&mut tx).await?;
                    let end = self.begin_compensation(&mut tx, &reason).await?;
                    tx.commit().await?;
                    self.put(conn);
                    if let Some(end) = self.after_compensation_began(end).await? {
                        return Ok(end);
                    }
                }
                Next::Run(i) => {
                    if let Some(end) = self.run_step(i, abandon).await? {
                        return Ok(end);
                    }
                }
            }
        }
    }

    /// What the process does next ([`decide::next`]).
    fn next(&self) -> Next {
        decide::next(
            &self.steps,
            self.phase,
            self.c.deadline_at,
            Utc::now(),
            |i| {
                matches!(
                    self.action(i),
                    Some((Action::Wait { .. } | Action::Timer(_), _, _))
                )
            },
        )
    }

    async fn process_change(
        &mut self,
        change: ProcessChange,
        reason: &str,
    ) -> Result<(), WriteError> {
        let mut conn = self.take().await?;
        self.c
            .lease
            .change_process(&mut conn, change, reason)
            .await?;
        self.put(conn);
        Ok(())
    }

    fn finished(&self, change: ProcessChange) {
        let status = match change {
            ProcessChange::Succeeded => ProcessStatus::Succeeded,
            ProcessChange::Failed => ProcessStatus::Failed,
            ProcessChange::Compensated => ProcessStatus::Compensated,
            ProcessChange::ManualReview => ProcessStatus::ManualReview,
            _ => return,
        };
        let latency = (Utc::now() - self.c.created_at)
            .to_std()
            .unwrap_or_default();
        events::finished(&self.c.kind, status.as_str(), latency);
    }

    fn context(&self, i: usize) -> StepContext {
        let s = &self.steps[i];
        let outputs: HashMap<String, serde_json::Value> = self
            .steps
            .iter()
            .filter(|o| o.role == Role::Forward && o.status == StepStatus::Succeeded)
            .filter_map(|o| o.output.clone().map(|v| (o.name.clone(), v)))
            .collect();
        let references: HashMap<String, String> = self
            .steps
            .iter()
            .filter(|o| o.role == Role::Forward && o.status == StepStatus::Succeeded)
            .filter_map(|o| o.reference().map(|r| (o.name.clone(), r.to_string())))
            .collect();
        let compensates = s.acts_on.and_then(|seq| {
            self.steps.iter().find(|o| o.seq == seq).and_then(|o| {
                o.reference().map(|r| Done {
                    reference: r.to_string(),
                    output: o.output.clone(),
                })
            })
        });
        StepContext {
            process_id: self.c.id(),
            kind: self.c.kind.clone(),
            business_key: self.c.business_key.clone(),
            step: s.name.clone(),
            role: s.role,
            attempt: s.attempts + 1,
            operation_id: s.operation_id,
            idempotency_key: (s.remote == Some(Remote::HonoursKey))
                .then(|| s.operation_id.to_string()),
            input: self.c.input.clone(),
            outputs,
            references,
            compensates,
        }
    }

    /// The action, retry policy and timeout of step `i` in this definition version.
    fn action(&self, i: usize) -> Option<(Action, RetryPolicy, Duration)> {
        let s = &self.steps[i];
        let d = self.def.step_named(&s.name)?;
        match s.role {
            Role::Forward => Some((d.action.clone(), d.retry, d.timeout)),
            Role::Compensation => d
                .compensation
                .as_ref()
                .map(|c| (c.action.clone(), c.retry, c.timeout)),
            Role::Resolution => None,
        }
    }

    /// The dependency step `i` calls, if its definition names one.
    fn dependency(&self, i: usize) -> Option<Dependency> {
        let s = &self.steps[i];
        let d = self.def.step_named(&s.name)?;
        match s.role {
            Role::Forward => d.dependency.clone(),
            Role::Compensation => d.compensation.as_ref()?.dependency.clone(),
            Role::Resolution => None,
        }
    }

    /// Runs step `i` by what its definition says it is.
    async fn run_step(
        &mut self,
        i: usize,
        abandon: &CancellationToken,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let Some((action, retry, timeout)) = self.action(i) else {
            let reason = format!(
                "definition {} v{} has no {} step {}",
                self.c.kind,
                self.c.version,
                self.steps[i].role.as_str(),
                self.steps[i].name
            );
            self.review(i, None, None, false, &reason).await?;
            return Ok(Some(TurnEnd::Parked));
        };
        match action {
            Action::Local(step) => self.run_local(i, (step, retry, timeout)).await,
            Action::Wait {
                remote,
                deadline,
                wait,
            } => {
                self.run_wait(i, remote, deadline, wait, retry, timeout)
                    .await
            }
            Action::Timer(timer) => self.run_timer(i, timer, retry).await,
            Action::External { remote, call } => {
                let ext = External {
                    remote,
                    call,
                    retry,
                    timeout,
                    started: Instant::now(),
                    doubt: decide::in_doubt(&self.steps[i]),
                    dependency: self.dependency(i),
                };
                self.run_external(i, &ext, abandon).await
            }
        }
    }

    /// External step `i`, in its phases: ask the dependency's circuit and limits (wait while
    /// they say so), settle the doubt an earlier attempt left, check the budget, begin the
    /// attempt (committed before the call), call, record the outcome.
    async fn run_external(
        &mut self,
        i: usize,
        ext: &External,
        abandon: &CancellationToken,
    ) -> Result<Option<TurnEnd>, WriteError> {
        // A doubt nothing can settle goes to review without asking the circuit.
        let settle_first = ext.doubt && ext.remote == Remote::Neither;
        if !settle_first && let ControlFlow::Break(end) = self.admit(i, ext).await? {
            return Ok(end);
        }
        if ext.doubt
            && let ControlFlow::Break(end) = self.resolve_doubt(i, ext).await?
        {
            return Ok(end);
        }
        if let ControlFlow::Break(end) = self.check_budget(i, ext).await? {
            return Ok(end);
        }
        self.begin_attempt(i, ext.doubt).await?;
        let Some(outcome) = self.call(i, ext, abandon).await? else {
            return Ok(Some(TurnEnd::Released));
        };
        self.record_outcome(i, ext, outcome).await
    }

    /// The previous attempt's outcome is unknown: what happens depends on the remote. One that
    /// offers neither a key nor a query goes to review; a queryable one is asked first
    /// ([`Self::query_in_doubt`]); one that honours the key is called again with it.
    async fn resolve_doubt(
        &mut self,
        i: usize,
        ext: &External,
    ) -> Result<ControlFlow<Option<TurnEnd>>, WriteError> {
        let name = self.steps[i].name.clone();
        match ext.remote {
            Remote::Neither => {
                events::unknown_outcome(&self.c.kind, &name, StepStatus::ManualReview.as_str());
                let reason = format!(
                    "outcome of attempt {} of {name} is unknown and the remote offers neither an idempotency key nor a status query",
                    self.steps[i].attempts
                );
                self.review_unknown(i, &reason, &reason).await
            }
            Remote::Queryable => {
                events::unknown_outcome(&self.c.kind, &name, "query");
                self.query_in_doubt(i, ext).await
            }
            Remote::HonoursKey => {
                events::unknown_outcome(&self.c.kind, &name, "retry_with_key");
                Ok(ControlFlow::Continue(()))
            }
        }
    }

    /// Asks a queryable remote by operation id whether the attempt in doubt happened: found is
    /// success, not found calls again, anything else is a person's decision (or, a transient
    /// failure of the lookup itself, a retry later with the outcome still unknown).
    async fn query_in_doubt(
        &mut self,
        i: usize,
        ext: &External,
    ) -> Result<ControlFlow<Option<TurnEnd>>, WriteError> {
        let ctx = self.context(i);
        let name = self.steps[i].name.clone();
        self.conn = None; // back to the pool for the query's duration
        let q = tokio::time::timeout(ext.timeout, ext.call.query(&ctx)).await;
        let end = match q {
            Ok(Ok(Lookup::Found(done))) => {
                self.record_health(Health::Answered).await;
                let why = "found at the remote by operation id after an unknown outcome";
                self.external_succeeded(i, done, why, ext.started).await?
            }
            Ok(Err(e)) if e.class == ErrorClass::Unavailable => {
                let message = format!("status query: {}", e.message);
                self.record_health(health_of_unavailable(&e)).await;
                let w = Unavailable {
                    message: &message,
                    retry_after: e.retry_after,
                    waiting_for: circuit_stopped(ext),
                    not_before: None,
                    uncount: false,
                };
                self.wait_unavailable(i, ext, w).await?
            }
            Ok(Ok(Lookup::NotFound)) => {
                tracing::info!(process = %self.c.id(), step = %name, "not found at the remote; calling again");
                return Ok(ControlFlow::Continue(()));
            }
            Ok(Ok(Lookup::Inconclusive(m))) => {
                let reason =
                    format!("outcome of {name} unknown and the status query was inconclusive: {m}");
                return self.review_unknown(i, &m, &reason).await;
            }
            Ok(Err(e))
                if e.class == ErrorClass::Transient
                    && self.steps[i].attempts < self.steps[i].max_attempts =>
            {
                // The lookup itself can be retried later; the outcome stays unknown.
                let e = StepError::unknown(format!("status query failed: {}", e.message));
                self.record_error(i, e, false, ext.retry, ext.started)
                    .await?
            }
            Ok(Err(e)) => {
                let reason = format!(
                    "outcome of {name} unknown and the status query failed: {}",
                    e.message
                );
                return self.review_unknown(i, &e.message, &reason).await;
            }
            Err(_) => {
                let reason = format!("outcome of {name} unknown and the status query timed out");
                return self.review_unknown(i, &reason, &reason).await;
            }
        };
        Ok(ControlFlow::Break(end))
    }

    /// Step `i` goes to review with an unknown outcome (`message`): the turn ends, parked.
    async fn review_unknown(
        &mut self,
        i: usize,
        message: &str,
        reason: &str,
    ) -> Result<ControlFlow<Option<TurnEnd>>, WriteError> {
        self.review(i, Some(ErrorClass::Unknown), Some(message), false, reason)
            .await?;
        Ok(ControlFlow::Break(Some(TurnEnd::Parked)))
    }

    /// Budget: a step out of attempts (or past its policy's deadline) is not called again. An
    /// unknown outcome that cannot be retried goes to review, never to failed.
    async fn check_budget(
        &mut self,
        i: usize,
        ext: &External,
    ) -> Result<ControlFlow<Option<TurnEnd>>, WriteError> {
        let s = &self.steps[i];
        let spent = decide::budget_spent(
            s.attempts,
            s.max_attempts,
            s.first_attempt_at,
            ext.retry.deadline,
            Utc::now(),
        );
        let Some(why) = spent else {
            return Ok(ControlFlow::Continue(()));
        };
        if ext.doubt {
            let reason = format!("{why} with the outcome of {} unknown", s.name);
            return self.review_unknown(i, &reason, &reason).await;
        }
        let e = StepError::new(
            s.error_class
                .as_deref()
                .and_then(ErrorClass::parse)
                .unwrap_or(ErrorClass::Transient),
            format!("{why} after {} attempts", s.attempts),
        );
        Ok(ControlFlow::Break(self.fail(i, e, false).await?))
    }

    /// Commits the attempt's beginning (so a crash mid-call leaves the step in doubt), and counts
    /// it in the turn's copy of the step.
    async fn begin_attempt(&mut self, i: usize, doubt: bool) -> Result<(), WriteError> {
        let s = &self.steps[i];
        let reason = if doubt {
            format!("attempt {} after an unknown outcome", s.attempts + 1)
        } else {
            format!("attempt {}", s.attempts + 1)
        };
        let seq = s.seq;
        let mut conn = self.take().await?;
        self.c
            .lease
            .change_step(&mut *conn, seq, &StepChange::Begin { reason: &reason })
            .await?;
        // Back to the pool for the call's duration (heartbeats need pool connections).
        drop(conn);
        let s = &mut self.steps[i];
        s.status = StepStatus::Running;
        s.attempts += 1;
        if s.first_attempt_at.is_none() {
            s.first_attempt_at = Some(Utc::now());
        }
        Ok(())
    }

    /// Calls the remote, within the step's timeout, unless the lease is lost meanwhile (then the
    /// result is discarded: fenced) or the shutdown's grace ends (then the process is released
    /// with the outcome unknown, and `None` says so).
    async fn call(
        &mut self,
        i: usize,
        ext: &External,
        abandon: &CancellationToken,
    ) -> Result<Option<CallOutcome>, WriteError> {
        let ctx = StepContext {
            attempt: self.steps[i].attempts,
            ..self.context(i)
        };
        let name = &self.steps[i].name;
        tokio::select! {
            r = tokio::time::timeout(ext.timeout, ext.call.call(&ctx)) => Ok(Some(r)),
            _ = self.lost.cancelled() => {
                tracing::warn!(process = %self.c.id(), step = %name, "lease lost during the call: its result is discarded (fenced)");
                Err(Fenced.into())
            }
            _ = abandon.cancelled() => {
                tracing::warn!(process = %self.c.id(), step = %name, "shutdown grace over: abandoning the call in flight; its outcome stays unknown");
                self.process_change(ProcessChange::Release, "released at shutdown").await?;
                Ok(None)
            }
        }
    }

    /// Records what the call answered: success, or an error ([`Self::record_error`]).
    async fn record_outcome(
        &mut self,
        i: usize,
        ext: &External,
        outcome: CallOutcome,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let (retry, started) = (ext.retry, ext.started);
        self.record_health(health(&outcome)).await;
        match outcome {
            // Nothing was done: the step waits, and the attempt it began is given back.
            Ok(Err(e)) if e.class == ErrorClass::Unavailable => {
                let w = Unavailable {
                    message: &e.message,
                    retry_after: e.retry_after,
                    waiting_for: circuit_stopped(ext),
                    not_before: None,
                    uncount: true,
                };
                self.wait_unavailable(i, ext, w).await
            }
            Ok(Ok(done)) => {
                self.external_succeeded(i, done, StepStatus::Succeeded.as_str(), started)
                    .await
            }
            // This attempt repeated one of unknown outcome with the same key. A transient error
            // (a 503 before the remote looked at the key, a refused connection) says nothing
            // about that earlier attempt: the outcome stays unknown, so the step stays in doubt
            // (stored as `unknown`, also for the next owner) and running out of attempts ends in
            // review, never in a failure whose compensation would treat the remote as if it had
            // not acted. (A queryable remote's doubt was settled by the lookup before this call;
            // a remote with neither was not called again.)
            Ok(Err(e))
                if ext.doubt
                    && ext.remote == Remote::HonoursKey
                    && e.class == ErrorClass::Transient =>
            {
                let e = StepError::unknown(format!(
                    "{}; the outcome of an earlier attempt is still unknown",
                    e.message
                ));
                self.record_error(i, e, false, retry, started).await
            }
            Ok(Err(e)) => self.record_error(i, e, false, retry, started).await,
            Err(_) => {
                let e = StepError::unknown(format!(
                    "no answer within {:?}; the remote may have acted",
                    ext.timeout
                ));
                self.record_error(i, e, false, retry, started).await
            }
        }
    }

    /// Wait step `i`: takes the event stored for its key if there is one; otherwise parks the
    /// process until the deadline (or the next query's backoff) unless a signal wakes it first;
    /// past them, queries a queryable remote (or goes to manual review): [`Self::wait_longer`].
    async fn run_wait(
        &mut self,
        i: usize,
        remote: Remote,
        deadline: Duration,
        wait: Arc<dyn WaitStep>,
        retry: RetryPolicy,
        timeout: Duration,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let started = Instant::now();
        let ctx = self.context(i);
        if let Some(outcome) = wait.already(&ctx) {
            return match outcome {
                Ok(done) => {
                    let why = "the outcome was known without waiting";
                    self.external_succeeded(i, done, why, started).await
                }
                Err(e) => self.record_error(i, e, false, retry, started).await,
            };
        }
        let key = match self.steps[i].wait_key.clone() {
            Some(k) => k,
            None => match wait.key(&ctx) {
                Ok(k) if !k.is_empty() && k.len() <= 500 => k,
                Ok(k) => {
                    let e = StepError::permanent(format!(
                        "the wait key is empty or longer than 500 bytes ({} bytes)",
                        k.len()
                    ));
                    return self.fail(i, e, false).await;
                }
                Err(e) => return self.record_error(i, e, false, retry, started).await,
            },
        };
        let mut conn = self.take().await?;
        let event = self.c.lease.event(&mut conn, &key).await?;
        self.put(conn);
        if let Some(payload) = event {
            events::wait_ended(&self.c.kind, &self.steps[i].name, "event");
            return match wait.received(&ctx, &key, &payload) {
                Ok(done) => {
                    let reason = format!("event {key} received");
                    self.external_succeeded(i, done, &reason, started).await
                }
                Err(e) => self.record_error(i, e, false, retry, started).await,
            };
        }
        let w = Wait {
            remote,
            deadline,
            wait,
            retry,
            timeout,
            started,
            key,
        };
        self.wait_longer(i, &w, &ctx).await
    }

    /// No event for wait step `i` yet: it begins waiting, or waits on while its deadline (or
    /// its next query) is ahead; past it, the remote is asked ([`Self::query_wait`]) where it
    /// can be and has budget left, or a person decides.
    async fn wait_longer(
        &mut self,
        i: usize,
        w: &Wait,
        ctx: &StepContext,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let now = Utc::now();
        let s = &self.steps[i];
        let (name, key) = (s.name.clone(), &w.key);
        if s.wait_key.is_none() {
            let until = crate::decide::later(now, w.deadline);
            return self.park(i, Some(key), until, true).await;
        }
        let due = if s.status == StepStatus::Retryable {
            s.next_attempt_at
        } else {
            s.wait_until
        };
        if let Some(due) = due
            && due > now
        {
            return self.park(i, Some(key), due, false).await;
        }
        let reason = if w.remote != Remote::Queryable {
            format!(
                "no event for {key} by the deadline of {name}, and the remote cannot be queried"
            )
        } else if decide::budget_spent(
            s.attempts,
            s.max_attempts,
            s.first_attempt_at,
            w.retry.deadline,
            now,
        )
        .is_some()
        {
            format!(
                "no event for {key} and no outcome from the remote after {} attempts of {name}",
                s.attempts
            )
        } else {
            events::unknown_outcome(&self.c.kind, &name, "query");
            return self.query_wait(i, w, ctx).await;
        };
        events::wait_ended(&self.c.kind, &name, StepStatus::ManualReview.as_str());
        self.review(i, Some(ErrorClass::Unknown), Some(&reason), false, &reason)
            .await?;
        Ok(Some(TurnEnd::Parked))
    }

    /// Wait step `i` is past its deadline: asks the queryable remote by the wait's key.
    async fn query_wait(
        &mut self,
        i: usize,
        w: &Wait,
        ctx: &StepContext,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let (name, key, started) = (self.steps[i].name.clone(), &w.key, w.started);
        self.conn = None; // back to the pool for the query's duration
        let q = tokio::time::timeout(w.timeout, w.wait.query(ctx, key)).await;
        let review = |m: String| format!("no event for {key} by the deadline of {name}; {m}");
        let review_status = StepStatus::ManualReview.as_str();
        match q {
            Ok(Ok(Lookup::Found(done))) => {
                events::wait_ended(&self.c.kind, &name, "query");
                let reason = review("the remote's status query found the outcome".into());
                self.external_succeeded(i, done, &reason, started).await
            }
            Ok(Ok(Lookup::NotFound)) => {
                events::wait_ended(&self.c.kind, &name, review_status);
                let reason = review("the remote has no record of it".into());
                self.review(i, Some(ErrorClass::Unknown), Some(&reason), true, &reason)
                    .await?;
                Ok(Some(TurnEnd::Parked))
            }
            Ok(Ok(Lookup::Inconclusive(m))) => {
                events::wait_ended(&self.c.kind, &name, review_status);
                let reason = review(format!("the status query was inconclusive: {m}"));
                self.review(i, Some(ErrorClass::Unknown), Some(&m), true, &reason)
                    .await?;
                Ok(Some(TurnEnd::Parked))
            }
            Ok(Err(e)) if e.class == ErrorClass::Permanent => {
                events::wait_ended(&self.c.kind, &name, "query");
                self.fail(i, e, true).await
            }
            Ok(Err(e)) => {
                let e = StepError::unknown(format!("status query: {}", e.message));
                self.record_error(i, e, true, w.retry, started).await
            }
            Err(_) => {
                let e =
                    StepError::unknown(format!("status query: no answer within {:?}", w.timeout));
                self.record_error(i, e, true, w.retry, started).await
            }
        }
    }

    /// Timer step `i`: continues once its time (stored when the process first reached it) came.
    async fn run_timer(
        &mut self,
        i: usize,
        timer: Arc<dyn TimerStep>,
        retry: RetryPolicy,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let started = Instant::now();
        let stored = self.steps[i].wait_until;
        let at = match stored {
            Some(at) => at,
            None => match timer.at(&self.context(i)) {
                Ok(at) => at,
                Err(e) => return self.record_error(i, e, false, retry, started).await,
            },
        };
        if at <= Utc::now() {
            let done = Done::new(format!("timer:{}", at.to_rfc3339()));
            return self
                .external_succeeded(i, done, "the timer's time came", started)
                .await;
        }
        self.park(i, None, at, stored.is_none()).await
    }

    /// Parks the process at wait or timer step `i` until `until` (or the process deadline, if
    /// sooner), releasing the lease; `first`: the step begins waiting now (its key and `until`
    /// are stored). For a wait, under the key's advisory lock ([`crate::signal`]): if an event
    /// came meanwhile, nothing is written and `None` says "run the step again".
    async fn park(
        &mut self,
        i: usize,
        key: Option<&str>,
        until: chrono::DateTime<Utc>,
        first: bool,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let next = match self.c.deadline_at {
            Some(d) if d < until => d,
            _ => until,
        };
        let mut conn = self.take().await?;
        let mut tx = conn.begin().await?;
        if let Some(key) = key {
            sqlx::query(crate::signal::KEY_LOCK)
                .bind(key)
                .execute(&mut *tx)
                .await?;
            if self.c.lease.event(&mut tx, key).await?.is_some() {
                tx.rollback().await?;
                self.put(conn);
                return Ok(None);
            }
        }
        self.c.lease.fence(&mut tx).await?;
        let name = self.steps[i].name.clone();
        let reason = match key {
            Some(key) => format!("{name} waits for event {key} until {}", until.to_rfc3339()),
            None => format!("{name} continues at {}", until.to_rfc3339()),
        };
        if first {
            self.c
                .lease
                .begin_wait(&mut tx, self.steps[i].seq, key, until, &reason)
                .await?;
        }
        self.c
            .lease
            .change_process(&mut tx, ProcessChange::WaitUntil(next), &reason)
            .await?;
        tx.commit().await?;
        self.put(conn);
        if first {
            let s = &mut self.steps[i];
            s.status = StepStatus::Running;
            s.attempts += 1;
            s.wait_key = key.map(str::to_string);
            s.wait_until = Some(until);
            s.first_attempt_at.get_or_insert_with(Utc::now);
            events::wait_began(
                &self.c.kind,
                &name,
                if key.is_some() { "event" } else { "timer" },
            );
        }
        Ok(Some(TurnEnd::Parked))
    }

    /// Step `i` (local) and the local steps right after it in this phase that are due now, at
    /// most `local_group` of them (fewer after a step of a longer group failed):
    /// [`decide::local_group`].
    fn local_group(&mut self, i: usize, first: LocalAction) -> Vec<(usize, LocalAction)> {
        let max = match self.group_cap.take() {
            Some((first, len)) if first == i => len,
            _ => self.sh.local_group,
        };
        let local = |j| matches!(self.action(j), Some((Action::Local(_), _, _)));
        let at = decide::local_group(
            &self.steps,
            i,
            max,
            self.phase,
            self.c.deadline_at,
            Utc::now(),
            local,
        );
        let mut group = vec![(i, first)];
        for j in at.into_iter().skip(1) {
            if let Some((Action::Local(step), retry, timeout)) = self.action(j) {
                group.push((j, (step, retry, timeout)));
            }
        }
        group
    }

    /// Runs local step `i`, and the local steps after it ([`Self::local_group`]), in one
    /// transaction: each effect in turn, then one fenced checkpoint of them all (and the process's
    /// end, if they were the last), then the commit. Every effect still commits with its own
    /// checkpoint or not at all; a crash rolls back the whole group and the next owner runs it
    /// again. If step k > 0 of the group fails, nothing of the group is kept: the steps before it
    /// run again as a group of k, then step k alone, so its error is recorded against the state
    /// the steps before it committed (a local step's code may thus run again, as after any
    /// rollback; its effects never commit twice).
    async fn run_local(
        &mut self,
        i: usize,
        first: LocalAction,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let group = self.local_group(i, first);
        let saved: Vec<StepRow> = group.iter().map(|(j, _)| self.steps[*j].clone()).collect();
        let mut conn = self.take().await?;
        let mut tx = conn.begin().await?;
        let mut done: Vec<(usize, Done, Duration)> = Vec::with_capacity(group.len());
        for (k, (j, (step, retry, timeout))) in group.iter().enumerate() {
            let (j, retry, timeout) = (*j, *retry, *timeout);
            if self.lost.is_cancelled() {
                return Err(Fenced.into());
            }
            let started = Instant::now();
            let ctx = self.context(j);
            let r = tokio::time::timeout(timeout, step.run(&ctx, &mut tx)).await;
            let (e, timed_out) = match r {
                Ok(Ok(d)) => {
                    // Visible to the next steps of the group (their outputs and references).
                    self.mark_succeeded(j, false, d.clone());
                    done.push((j, d, started.elapsed()));
                    continue;
                }
                Ok(Err(e)) => (e, false),
                Err(_) => (
                    StepError::transient(format!("timed out after {timeout:?}; rolled back")),
                    true,
                ),
            };
            drop(tx); // rolls the effects back
            if timed_out {
                // The step's future was dropped mid-statement: the pool tests the connection.
                drop(conn);
            } else {
                self.put(conn);
            }
            for ((j, _), row) in group.iter().zip(saved) {
                self.steps[*j] = row;
            }
            return self.local_failed(i, k, j, e, retry, started).await;
        }
        let finish = decide::all_succeeded(&self.steps, self.steps[i].role).then_some(self.phase);
        self.checkpoint(&mut tx, i, &done, finish).await?;
        tx.commit().await?;
        self.put(conn);
        for (j, _, took) in &done {
            events::step_attempt(
                &self.c.kind,
                &self.steps[*j].name,
                StepStatus::Succeeded.as_str(),
                "none",
                *took,
            );
        }
        if let Some(phase) = finish {
            self.finished(phase.end().0);
            return Ok(Some(TurnEnd::Finished));
        }
        Ok(None)
    }

    /// Step `j`, the `k`-th of the local group from step `i`, failed with `e` (the group rolled
    /// back): alone, its error is recorded; in a group, the steps before it run again first.
    async fn local_failed(
        &mut self,
        i: usize,
        k: usize,
        j: usize,
        e: StepError,
        retry: RetryPolicy,
        started: Instant,
    ) -> Result<Option<TurnEnd>, WriteError> {
        if k == 0 {
            return self.record_error(j, e, true, retry, started).await;
        }
        tracing::debug!(process = %self.c.id(), step = %self.steps[j].name, error = %e.message, "a step of a local group failed; running the steps before it alone first");
        self.group_cap = Some((i, k));
        Ok(None)
    }

    /// The fenced checkpoint of the local group from step `i` whose effects ran in `tx`, and with
    /// `finish` the end of the process: every step of the phase succeeded.
    async fn checkpoint(
        &mut self,
        tx: &mut sqlx::PgConnection,
        i: usize,
        done: &[(usize, Done, Duration)],
        finish: Option<Phase>,
    ) -> Result<(), WriteError> {
        let successes: Vec<store::LocalSuccess<'_>> = done
            .iter()
            .map(|(j, d, _)| store::LocalSuccess {
                seq: self.steps[*j].seq,
                reference: &d.reference,
                output: d.output.as_ref(),
            })
            .collect();
        let finish = finish.map(|phase| match phase {
            Phase::Forward => (store::Finish::Succeeded, phase.end().1),
            Phase::Compensating => (store::Finish::Compensated, phase.end().1),
        });
        let fenced = self.c.lease.checkpoint_local(tx, &successes, finish).await;
        if let Err(WriteError::Fenced(_)) = fenced {
            events::fenced(&self.c.kind);
            tracing::warn!(process = %self.c.id(), step = %self.steps[i].name, "checkpoint fenced off: another worker holds the lease; the effects are rolled back");
        }
        fenced
    }

    fn mark_succeeded(&mut self, i: usize, remote: bool, done: Done) {
        let s = &mut self.steps[i];
        s.status = StepStatus::Succeeded;
        s.next_attempt_at = None;
        if remote {
            s.remote_ref = Some(done.reference);
        } else {
            s.result_ref = Some(done.reference);
            s.attempts += 1;
        }
        s.output = done.output;
    }

    async fn external_succeeded(
        &mut self,
        i: usize,
        done: Done,
        reason: &str,
        started: Instant,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let last = decide::is_last(&self.steps, i);
        let mut conn = self.take().await?;
        let mut tx = conn.begin().await?;
        let fenced = self
            .c
            .lease
            .change_step(
                &mut *tx,
                self.steps[i].seq,
                &StepChange::Succeeded {
                    remote: true,
                    reference: &redact::truncate(&done.reference, 500),
                    output: done.output.as_ref(),
                    count_attempt: false,
                    reason,
                },
            )
            .await;
        if let Err(WriteError::Fenced(_)) = fenced {
            events::fenced(&self.c.kind);
            tracing::warn!(process = %self.c.id(), step = %self.steps[i].name, "completion fenced off: another worker holds the lease");
        }
        fenced?;
        let finish = last.then_some(match self.phase {
            Phase::Forward => ProcessChange::Succeeded,
            Phase::Compensating => ProcessChange::Compensated,
        });
        if let Some(change) = finish {
            self.c
                .lease
                .change_process(&mut tx, change, "every step succeeded")
                .await?;
        }
        tx.commit().await?;
        self.put(conn);
        events::step_attempt(
            &self.c.kind,
            &self.steps[i].name,
            StepStatus::Succeeded.as_str(),
            "none",
            started.elapsed(),
        );
        self.mark_succeeded(i, true, done);
        if let Some(change) = finish {
            self.finished(change);
            return Ok(Some(TurnEnd::Finished));
        }
        Ok(None)
    }

    /// A step attempt failed with `e`: retry, fail (and compensate) or review, by class and budget
    /// ([`decide::after_error`]).
    async fn record_error(
        &mut self,
        i: usize,
        e: StepError,
        count_attempt: bool,
        retry: RetryPolicy,
        started: Instant,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let s = &self.steps[i];
        let message = redact::message(&e.message);
        let class = e.class;
        events::step_attempt(
            &self.c.kind,
            &s.name,
            "error",
            class.as_str(),
            started.elapsed(),
        );
        let now = Utc::now();
        let (at, attempts) =
            match decide::after_error(s, class, &message, count_attempt, &retry, now) {
                AfterError::Review {
                    reason,
                    unknown_outcome,
                } => {
                    if unknown_outcome {
                        let review = StepStatus::ManualReview.as_str();
                        events::unknown_outcome(&self.c.kind, &s.name, review);
                    }
                    self.review(i, Some(class), Some(&message), count_attempt, &reason)
                        .await?;
                    return Ok(Some(TurnEnd::Parked));
                }
                AfterError::Fail(e) => return self.fail(i, e, count_attempt).await,
                AfterError::Retry { at, attempts } => (at, attempts),
            };
        let reason = format!(
            "{} error on attempt {attempts}; next attempt at {}",
            class.as_str(),
            at.to_rfc3339()
        );
        let seq = s.seq;
        let mut conn = self.take().await?;
        let change = StepChange::Retryable {
            class: class.as_str(),
            message: &message,
            at,
            count_attempt,
            reason: &reason,
        };
        self.c.lease.change_step(&mut *conn, seq, &change).await?;
        self.put(conn);
        let s = &mut self.steps[i];
        s.status = StepStatus::Retryable;
        s.attempts = attempts;
        s.next_attempt_at = Some(at);
        s.error_class = Some(class.as_str().into());
        if s.first_attempt_at.is_none() {
            s.first_attempt_at = Some(now);
        }
        Ok(None)
    }

    /// Step `i` failed for good: a forward step starts compensation (or fails the process), a
    /// compensation goes to manual review.
    async fn fail(
        &mut self,
        i: usize,
        e: StepError,
        count_attempt: bool,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let message = redact::message(&e.message);
        if self.steps[i].role == Role::Compensation {
            let reason = format!("compensation of {} failed: {message}", self.steps[i].name);
            self.review(i, Some(e.class), Some(&message), count_attempt, &reason)
                .await?;
            return Ok(Some(TurnEnd::Parked));
        }
        let reason = format!(
            "step {} failed ({}): {message}",
            self.steps[i].name, e.class
        );
        let mut conn = self.take().await?;
        let mut tx = conn.begin().await?;
        self.c.lease.fence(&mut tx).await?;
        self.c
            .lease
            .change_step(
                &mut *tx,
                self.steps[i].seq,
                &StepChange::Failed {
                    class: e.class.as_str(),
                    message: &message,
                    count_attempt,
                    reason: &reason,
                },
            )
            .await?;
        self.steps[i].status = StepStatus::Failed;
        let end = self.begin_compensation(&mut tx, &reason).await?;
        tx.commit().await?;
        self.put(conn);
        events::step_attempt(
            &self.c.kind,
            &self.steps[i].name,
            StepStatus::Failed.as_str(),
            e.class.as_str(),
            Duration::ZERO,
        );
        self.after_compensation_began(end).await
    }

    /// Inside a fenced transaction: adds compensations for the forward steps that succeeded, in
    /// reverse order, and moves the process to compensating; or fails it if there is nothing to
    /// undo ([`decide::compensation_plan`]). Returns the change made.
    async fn begin_compensation(
        &mut self,
        tx: &mut sqlx::PgConnection,
        reason: &str,
    ) -> Result<ProcessChange, WriteError> {
        let compensation = |name: &str| {
            self.def
                .step_named(name)
                .and_then(|d| d.compensation.as_ref())
        };
        let plan = match decide::compensation_plan(&self.steps, |s| compensation(&s.name).is_some())
        {
            Undo::Nothing => {
                let lease = &self.c.lease;
                lease
                    .change_process(tx, ProcessChange::Failed, reason)
                    .await?;
                return Ok(ProcessChange::Failed);
            }
            Undo::Compensate(plan) => plan,
        };
        let comps: Vec<store::NewCompensation> = plan
            .into_iter()
            .filter_map(|s| {
                compensation(&s.name).map(|c| store::NewCompensation {
                    acts_on: s.seq,
                    name: s.name.clone(),
                    execution: c.action.execution(),
                    remote: c.action.remote().map(|r| r.as_str()),
                    sensitive: c.sensitive,
                    max_attempts: c.retry.max_attempts.max(1),
                    label: c.label.clone(),
                })
            })
            .collect();
        let lease = &self.c.lease;
        lease.add_compensations(tx, &comps, reason).await?;
        lease
            .change_process(tx, ProcessChange::Compensating, reason)
            .await?;
        Ok(ProcessChange::Compensating)
    }

    async fn after_compensation_began(
        &mut self,
        change: ProcessChange,
    ) -> Result<Option<TurnEnd>, WriteError> {
        if change == ProcessChange::Failed {
            self.finished(change);
            return Ok(Some(TurnEnd::Finished));
        }
        self.phase = Phase::Compensating;
        let mut conn = self.take().await?;
        self.steps = self.c.lease.steps(&mut conn).await?;
        self.put(conn);
        Ok(None)
    }

    /// Step `i` and the process go to manual review.
    async fn review(
        &mut self,
        i: usize,
        class: Option<ErrorClass>,
        message: Option<&str>,
        count_attempt: bool,
        reason: &str,
    ) -> Result<(), WriteError> {
        let message = message.map(redact::message);
        let mut conn = self.take().await?;
        let mut tx = conn.begin().await?;
        self.c.lease.fence(&mut tx).await?;
        if self.steps[i].status != StepStatus::ManualReview {
            self.c
                .lease
                .change_step(
                    &mut *tx,
                    self.steps[i].seq,
                    &StepChange::Review {
                        class: class.map(|c| c.as_str()),
                        message: message.as_deref(),
                        count_attempt,
                        reason,
                    },
                )
                .await?;
        }
        self.c
            .lease
            .change_process(&mut tx, ProcessChange::ManualReview, reason)
            .await?;
        tx.commit().await?;
        self.put(conn);
        self.steps[i].status = StepStatus::ManualReview;
        tracing::warn!(process = %self.c.id(), kind = %self.c.kind, step = %self.steps[i].name, reason, "process needs manual review");
        events::step_attempt(
            &self.c.kind,
            &self.steps[i].name,
            StepStatus::ManualReview.as_str(),
            class.map(|c| c.as_str()).unwrap_or("none"),
            Duration::ZERO,
        );
        self.finished(ProcessChange::ManualReview);
        Ok(())
    }
}
