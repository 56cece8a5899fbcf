//! Runs one claimed process until it finishes, waits, needs a person, or the lease is lost.
//!
//! The worker holds the lease for the whole turn (heartbeats extend it during long calls) and
//! runs steps in order. A local step's effect and checkpoint commit in one transaction, whose
//! checkpoint statement takes the fence; consecutive local steps share that transaction and that
//! statement (a *local group*, [`Run::run_local`]).
//! An external step commits its attempt first, then calls; if the previous attempt's outcome is
//! unknown (its worker died mid-call, or it timed out) what happens depends on the remote:
//! same key again, a status query first, or manual review. Nothing is ever marked done
//! without the evidence the remote or the local transaction gave.

use crate::definition::{
    Action, Definition, Done, LocalStep, Lookup, Remote, Role, StepContext, TimerStep, WaitStep,
};
use crate::error::{ErrorClass, StepError};
use crate::internal_events as events;
use crate::redact;
use crate::retry::RetryPolicy;
use crate::status::{ProcessStatus, StepStatus};
use crate::store::{self, Claimed, Fenced, ProcessChange, StepChange, StepRow, WriteError};
use chrono::Utc;
use shared::schema::Schema;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgPool, Postgres};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A local step's action with its retry policy and timeout.
type LocalAction = (Arc<dyn LocalStep>, RetryPolicy, Duration);

/// What the worker shares with every run.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub pool: PgPool,
    /// Connections of turns that ended, for the next turns while the worker has work.
    pub spare: Spare,
    pub schema: Schema,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Forward,
    Compensating,
}

/// The step to run, or what the process does instead.
enum Next {
    Run(usize),
    Wait(chrono::DateTime<Utc>),
    Finish(ProcessChange, String),
    Review(usize, String),
    /// A forward step failed (an operator resolved it so): compensate.
    Compensate(String),
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
        c.id,
        c.token,
        c.kind.clone(),
        lost.clone(),
        beat_done.clone(),
    ));
    let phase = if c.status == ProcessStatus::Compensating {
        Phase::Compensating
    } else {
        Phase::Forward
    };
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
    };
    let result = r.turn(&stop, &abandon).await;
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
    id: uuid::Uuid,
    token: i64,
    kind: String,
    lost: CancellationToken,
    done: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(sh.heartbeat) => {}
            _ = done.cancelled() => return,
        }
        match store::heartbeat(&sh.pool, &sh.schema, id, token, sh.lease).await {
            Ok(()) => {}
            Err(WriteError::Fenced(_)) => {
                events::fenced(&kind);
                tracing::warn!(process = %id, token, "heartbeat fenced: the lease was taken over; abandoning the process");
                lost.cancel();
                return;
            }
            Err(WriteError::Database(e)) => {
                tracing::warn!(process = %id, error = %e, "heartbeat failed; retrying");
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
                    store::fence(&mut tx, &self.sh.schema, self.c.id, self.c.token).await?;
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

    fn next(&self) -> Next {
        let now = Utc::now();
        let role = match self.phase {
            Phase::Forward => Role::Forward,
            Phase::Compensating => Role::Compensation,
        };
        let Some(i) = self
            .steps
            .iter()
            .position(|s| s.role == role && s.status != StepStatus::Succeeded)
        else {
            return match self.phase {
                Phase::Forward => {
                    Next::Finish(ProcessChange::Succeeded, "every step succeeded".into())
                }
                Phase::Compensating => Next::Finish(
                    ProcessChange::Compensated,
                    "every compensation succeeded".into(),
                ),
            };
        };
        let s = &self.steps[i];
        match (self.phase, s.status) {
            (Phase::Forward, StepStatus::Failed) => {
                Next::Compensate(format!("step {} failed", s.name))
            }
            (Phase::Compensating, StepStatus::Failed) => {
                Next::Review(i, format!("compensation of {} failed", s.name))
            }
            (_, StepStatus::ManualReview) => Next::Finish(
                ProcessChange::ManualReview,
                format!("step {} needs a decision (manual review)", s.name),
            ),
            _ => {
                if self.phase == Phase::Forward
                    && let Some(deadline) = self.c.deadline_at
                    && deadline <= now
                {
                    if in_doubt(s) {
                        return Next::Review(
                            i,
                            format!(
                                "process deadline passed with the outcome of {} unknown",
                                s.name
                            ),
                        );
                    }
                    return Next::Compensate(format!(
                        "process deadline passed before {} succeeded",
                        s.name
                    ));
                }
                // A wait or timer decides itself whether it is due: a signal may have woken it
                // before its backoff or deadline.
                if matches!(
                    self.action(i),
                    Some((Action::Wait { .. } | Action::Timer(_), _, _))
                ) {
                    return Next::Run(i);
                }
                match s.next_attempt_at {
                    Some(at) if s.status == StepStatus::Retryable && at > now => Next::Wait(at),
                    _ => Next::Run(i),
                }
            }
        }
    }

    async fn process_change(
        &mut self,
        change: ProcessChange,
        reason: &str,
    ) -> Result<(), WriteError> {
        let mut conn = self.take().await?;
        store::change_process(
            &mut conn,
            &self.sh.schema,
            self.c.id,
            self.c.token,
            change,
            reason,
        )
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
            process_id: self.c.id,
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

    /// Is this the last step of the phase still to succeed (so its checkpoint can finish the process)?
    fn is_last(&self, i: usize) -> bool {
        let role = self.steps[i].role;
        !self
            .steps
            .iter()
            .enumerate()
            .any(|(j, s)| j != i && s.role == role && s.status != StepStatus::Succeeded)
    }

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
        let started = Instant::now();
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
                let s = &self.steps[i];
                let doubt = in_doubt(s);
                let name = s.name.clone();
                let seq = s.seq;
                if doubt {
                    match remote {
                        Remote::Neither => {
                            events::unknown_outcome(
                                &self.c.kind,
                                &name,
                                StepStatus::ManualReview.as_str(),
                            );
                            let reason = format!(
                                "outcome of attempt {} of {name} is unknown and the remote offers neither an idempotency key nor a status query",
                                s.attempts
                            );
                            self.review(
                                i,
                                Some(ErrorClass::Unknown),
                                Some(&reason),
                                false,
                                &reason,
                            )
                            .await?;
                            return Ok(Some(TurnEnd::Parked));
                        }
                        Remote::Queryable => {
                            events::unknown_outcome(&self.c.kind, &name, "query");
                            let ctx = self.context(i);
                            self.conn = None; // back to the pool for the query's duration
                            let q = tokio::time::timeout(timeout, call.query(&ctx)).await;
                            match q {
                                Ok(Ok(Lookup::Found(done))) => {
                                    return self
                                        .external_succeeded(i, done, "found at the remote by operation id after an unknown outcome", started)
                                        .await;
                                }
                                Ok(Ok(Lookup::NotFound)) => {
                                    tracing::info!(process = %self.c.id, step = %name, "not found at the remote; calling again");
                                }
                                Ok(Ok(Lookup::Inconclusive(m))) => {
                                    let reason = format!(
                                        "outcome of {name} unknown and the status query was inconclusive: {m}"
                                    );
                                    self.review(
                                        i,
                                        Some(ErrorClass::Unknown),
                                        Some(&m),
                                        false,
                                        &reason,
                                    )
                                    .await?;
                                    return Ok(Some(TurnEnd::Parked));
                                }
                                Ok(Err(e)) => {
                                    if e.class == ErrorClass::Transient
                                        && s.attempts < s.max_attempts
                                    {
                                        // The lookup itself can be retried later; the outcome stays unknown.
                                        let e = StepError::unknown(format!(
                                            "status query failed: {}",
                                            e.message
                                        ));
                                        return self
                                            .record_error(i, e, false, retry, started)
                                            .await;
                                    }
                                    let reason = format!(
                                        "outcome of {name} unknown and the status query failed: {}",
                                        e.message
                                    );
                                    self.review(
                                        i,
                                        Some(ErrorClass::Unknown),
                                        Some(&e.message),
                                        false,
                                        &reason,
                                    )
                                    .await?;
                                    return Ok(Some(TurnEnd::Parked));
                                }
                                Err(_) => {
                                    let reason = format!(
                                        "outcome of {name} unknown and the status query timed out"
                                    );
                                    self.review(
                                        i,
                                        Some(ErrorClass::Unknown),
                                        Some(&reason),
                                        false,
                                        &reason,
                                    )
                                    .await?;
                                    return Ok(Some(TurnEnd::Parked));
                                }
                            }
                        }
                        Remote::HonoursKey => {
                            events::unknown_outcome(&self.c.kind, &name, "retry_with_key");
                        }
                    }
                }
                // Budget: an unknown outcome that cannot be retried goes to review, never to failed.
                let s = &self.steps[i];
                let over_deadline =
                    retry
                        .deadline
                        .zip(s.first_attempt_at)
                        .is_some_and(|(d, first)| {
                            first + chrono::Duration::from_std(d).unwrap_or(chrono::TimeDelta::MAX)
                                <= Utc::now()
                        });
                if s.attempts >= s.max_attempts || over_deadline {
                    let why = if over_deadline {
                        "deadline passed"
                    } else {
                        "attempts exhausted"
                    };
                    if doubt {
                        let reason = format!("{why} with the outcome of {name} unknown");
                        self.review(i, Some(ErrorClass::Unknown), Some(&reason), false, &reason)
                            .await?;
                        return Ok(Some(TurnEnd::Parked));
                    }
                    let e = StepError::new(
                        s.error_class
                            .as_deref()
                            .and_then(ErrorClass::parse)
                            .unwrap_or(ErrorClass::Transient),
                        format!("{why} after {} attempts", s.attempts),
                    );
                    return self.fail(i, e, false).await;
                }
                let reason = if doubt {
                    format!("attempt {} after an unknown outcome", s.attempts + 1)
                } else {
                    format!("attempt {}", s.attempts + 1)
                };
                let mut conn = self.take().await?;
                store::change_step(
                    &mut *conn,
                    &self.sh.schema,
                    self.c.id,
                    self.c.token,
                    seq,
                    &StepChange::Begin { reason: &reason },
                )
                .await?;
                // Back to the pool for the call's duration (heartbeats need pool connections).
                drop(conn);
                self.steps[i].status = StepStatus::Running;
                self.steps[i].attempts += 1;
                if self.steps[i].first_attempt_at.is_none() {
                    self.steps[i].first_attempt_at = Some(Utc::now());
                }
                let ctx = self.context(i);
                let ctx = StepContext {
                    attempt: self.steps[i].attempts,
                    ..ctx
                };
                let outcome = tokio::select! {
                    r = tokio::time::timeout(timeout, call.call(&ctx)) => Some(r),
                    _ = self.lost.cancelled() => None,
                    _ = abandon.cancelled() => {
                        tracing::warn!(process = %self.c.id, step = %name, "shutdown grace over: abandoning the call in flight; its outcome stays unknown");
                        self.process_change(ProcessChange::Release, "released at shutdown").await?;
                        return Ok(Some(TurnEnd::Released));
                    }
                };
                let Some(outcome) = outcome else {
                    tracing::warn!(process = %self.c.id, step = %name, "lease lost during the call: its result is discarded (fenced)");
                    return Err(Fenced.into());
                };
                match outcome {
                    Ok(Ok(done)) => {
                        self.external_succeeded(i, done, StepStatus::Succeeded.as_str(), started)
                            .await
                    }
                    // This attempt repeated one of unknown outcome with the same key. A transient
                    // error (a 503 before the remote looked at the key, a refused connection)
                    // says nothing about that earlier attempt: the outcome stays unknown, so the
                    // step stays in doubt (stored as `unknown`, also for the next owner) and
                    // running out of attempts ends in review, never in a failure whose
                    // compensation would treat the remote as if it had not acted. (A queryable
                    // remote's doubt was settled by the lookup before this call; a remote with
                    // neither was not called again.)
                    Ok(Err(e))
                        if doubt
                            && remote == Remote::HonoursKey
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
                            "no answer within {timeout:?}; the remote may have acted"
                        ));
                        self.record_error(i, e, false, retry, started).await
                    }
                }
            }
        }
    }

    /// Wait step `i`: takes the event stored for its key if there is one; otherwise parks the
    /// process until the deadline (or the next query's backoff) unless a signal wakes it first;
    /// past them, queries a queryable remote (or goes to manual review).
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
                    self.external_succeeded(
                        i,
                        done,
                        "the outcome was known without waiting",
                        started,
                    )
                    .await
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
        let event = store::event(&mut conn, &self.sh.schema, &key).await?;
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
        let now = Utc::now();
        let s = &self.steps[i];
        let name = s.name.clone();
        if s.wait_key.is_none() {
            let until =
                now + chrono::Duration::from_std(deadline).unwrap_or(chrono::TimeDelta::MAX);
            return self.park(i, Some(&key), until, true).await;
        }
        let due = if s.status == StepStatus::Retryable {
            s.next_attempt_at
        } else {
            s.wait_until
        };
        if let Some(due) = due
            && due > now
        {
            return self.park(i, Some(&key), due, false).await;
        }
        if remote != Remote::Queryable {
            events::wait_ended(&self.c.kind, &name, StepStatus::ManualReview.as_str());
            let reason = format!(
                "no event for {key} by the deadline of {name}, and the remote cannot be queried"
            );
            self.review(i, Some(ErrorClass::Unknown), Some(&reason), false, &reason)
                .await?;
            return Ok(Some(TurnEnd::Parked));
        }
        let over_deadline = retry
            .deadline
            .zip(s.first_attempt_at)
            .is_some_and(|(d, first)| {
                first + chrono::Duration::from_std(d).unwrap_or(chrono::TimeDelta::MAX) <= now
            });
        if s.attempts >= s.max_attempts || over_deadline {
            events::wait_ended(&self.c.kind, &name, StepStatus::ManualReview.as_str());
            let reason = format!(
                "no event for {key} and no outcome from the remote after {} attempts of {name}",
                s.attempts
            );
            self.review(i, Some(ErrorClass::Unknown), Some(&reason), false, &reason)
                .await?;
            return Ok(Some(TurnEnd::Parked));
        }
        events::unknown_outcome(&self.c.kind, &name, "query");
        self.conn = None; // back to the pool for the query's duration
        let q = tokio::time::timeout(timeout, wait.query(&ctx, &key)).await;
        let review = |m: String| format!("no event for {key} by the deadline of {name}; {m}");
        match q {
            Ok(Ok(Lookup::Found(done))) => {
                events::wait_ended(&self.c.kind, &name, "query");
                let reason = review("the remote's status query found the outcome".into());
                self.external_succeeded(i, done, &reason, started).await
            }
            Ok(Ok(Lookup::NotFound)) => {
                events::wait_ended(&self.c.kind, &name, StepStatus::ManualReview.as_str());
                let reason = review("the remote has no record of it".into());
                self.review(i, Some(ErrorClass::Unknown), Some(&reason), true, &reason)
                    .await?;
                Ok(Some(TurnEnd::Parked))
            }
            Ok(Ok(Lookup::Inconclusive(m))) => {
                events::wait_ended(&self.c.kind, &name, StepStatus::ManualReview.as_str());
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
                self.record_error(i, e, true, retry, started).await
            }
            Err(_) => {
                let e = StepError::unknown(format!("status query: no answer within {timeout:?}"));
                self.record_error(i, e, true, retry, started).await
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
            if store::event(&mut tx, &self.sh.schema, key).await?.is_some() {
                tx.rollback().await?;
                self.put(conn);
                return Ok(None);
            }
        }
        store::fence(&mut tx, &self.sh.schema, self.c.id, self.c.token).await?;
        let name = self.steps[i].name.clone();
        let reason = match key {
            Some(key) => format!("{name} waits for event {key} until {}", until.to_rfc3339()),
            None => format!("{name} continues at {}", until.to_rfc3339()),
        };
        if first {
            store::begin_wait(
                &mut tx,
                &self.sh.schema,
                self.c.id,
                self.c.token,
                self.steps[i].seq,
                key,
                until,
                &reason,
            )
            .await?;
        }
        store::change_process(
            &mut tx,
            &self.sh.schema,
            self.c.id,
            self.c.token,
            ProcessChange::WaitUntil(next),
            &reason,
        )
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
    /// most `local_group` of them (fewer after a step of a longer group failed).
    fn local_group(&mut self, i: usize, first: LocalAction) -> Vec<(usize, LocalAction)> {
        let max = match self.group_cap.take() {
            Some((first, len)) if first == i => len,
            _ => self.sh.local_group,
        }
        .max(1);
        let role = self.steps[i].role;
        let now = Utc::now();
        let past_deadline = self.phase == Phase::Forward
            && self.c.deadline_at.is_some_and(|deadline| deadline <= now);
        let mut group = vec![(i, first)];
        for (j, s) in self.steps.iter().enumerate().skip(i + 1) {
            if group.len() >= max || past_deadline {
                break;
            }
            if s.role != role || s.status == StepStatus::Succeeded {
                continue;
            }
            let due = s.status == StepStatus::Pending
                || (s.status == StepStatus::Retryable
                    && s.next_attempt_at.is_none_or(|at| at <= now));
            match self.action(j) {
                Some((Action::Local(step), retry, timeout)) if due => {
                    group.push((j, (step, retry, timeout)));
                }
                _ => break,
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
            if k == 0 {
                return self.record_error(j, e, true, retry, started).await;
            }
            tracing::debug!(process = %self.c.id, step = %self.steps[j].name, error = %e.message, "a step of a local group failed; running the steps before it alone first");
            self.group_cap = Some((i, k));
            return Ok(None);
        }
        let successes: Vec<store::LocalSuccess<'_>> = done
            .iter()
            .map(|(j, d, _)| store::LocalSuccess {
                seq: self.steps[*j].seq,
                reference: &d.reference,
                output: d.output.as_ref(),
            })
            .collect();
        let role = self.steps[i].role;
        let finish = (!self
            .steps
            .iter()
            .any(|s| s.role == role && s.status != StepStatus::Succeeded))
        .then_some(match self.phase {
            Phase::Forward => (store::Finish::Succeeded, "every step succeeded"),
            Phase::Compensating => (store::Finish::Compensated, "every compensation succeeded"),
        });
        let fenced = store::checkpoint_local(
            &mut tx,
            &self.sh.schema,
            self.c.id,
            self.c.token,
            &successes,
            finish,
        )
        .await;
        if let Err(WriteError::Fenced(_)) = fenced {
            events::fenced(&self.c.kind);
            tracing::warn!(process = %self.c.id, step = %self.steps[i].name, "checkpoint fenced off: another worker holds the lease; the effects are rolled back");
        }
        fenced?;
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
        if let Some((end, _)) = finish {
            self.finished(match end {
                store::Finish::Succeeded => ProcessChange::Succeeded,
                store::Finish::Compensated => ProcessChange::Compensated,
            });
            return Ok(Some(TurnEnd::Finished));
        }
        Ok(None)
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
        let last = self.is_last(i);
        let mut conn = self.take().await?;
        let mut tx = conn.begin().await?;
        let fenced = store::change_step(
            &mut *tx,
            &self.sh.schema,
            self.c.id,
            self.c.token,
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
            tracing::warn!(process = %self.c.id, step = %self.steps[i].name, "completion fenced off: another worker holds the lease");
        }
        fenced?;
        let finish = last.then_some(match self.phase {
            Phase::Forward => ProcessChange::Succeeded,
            Phase::Compensating => ProcessChange::Compensated,
        });
        if let Some(change) = finish {
            store::change_process(
                &mut tx,
                &self.sh.schema,
                self.c.id,
                self.c.token,
                change,
                "every step succeeded",
            )
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

    /// A step attempt failed with `e`: retry, fail (and compensate) or review, by class and budget.
    async fn record_error(
        &mut self,
        i: usize,
        e: StepError,
        count_attempt: bool,
        retry: RetryPolicy,
        started: Instant,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let s = &self.steps[i];
        let attempts = s.attempts + i32::from(count_attempt);
        let message = redact::message(&e.message);
        let class = e.class;
        events::step_attempt(
            &self.c.kind,
            &s.name,
            "error",
            class.as_str(),
            started.elapsed(),
        );
        if class == ErrorClass::Unknown && s.remote == Some(Remote::Neither) {
            events::unknown_outcome(&self.c.kind, &s.name, StepStatus::ManualReview.as_str());
            let reason = format!(
                "outcome of {} unknown ({message}) and the remote offers neither key nor query",
                s.name
            );
            self.review(i, Some(class), Some(&message), count_attempt, &reason)
                .await?;
            return Ok(Some(TurnEnd::Parked));
        }
        if class == ErrorClass::Permanent {
            return self
                .fail(i, StepError::permanent(message), count_attempt)
                .await;
        }
        let now = Utc::now();
        let at = now
            + chrono::Duration::from_std(retry.delay_after(attempts))
                .unwrap_or(chrono::TimeDelta::zero());
        let first = s.first_attempt_at.unwrap_or(now);
        let past_deadline = retry.deadline.is_some_and(|d| {
            first + chrono::Duration::from_std(d).unwrap_or(chrono::TimeDelta::MAX) <= at
        });
        if attempts >= s.max_attempts || past_deadline {
            let why = if past_deadline {
                "deadline passed"
            } else {
                "attempts exhausted"
            };
            if class == ErrorClass::Unknown || s.role == Role::Compensation {
                let reason = format!("{why} ({attempts} attempts) for {}: {message}", s.name);
                self.review(i, Some(class), Some(&message), count_attempt, &reason)
                    .await?;
                return Ok(Some(TurnEnd::Parked));
            }
            return self
                .fail(
                    i,
                    StepError::new(class, format!("{why} after {attempts} attempts: {message}")),
                    count_attempt,
                )
                .await;
        }
        let reason = format!(
            "{} error on attempt {attempts}; next attempt at {}",
            class.as_str(),
            at.to_rfc3339()
        );
        let seq = s.seq;
        let mut conn = self.take().await?;
        store::change_step(
            &mut *conn,
            &self.sh.schema,
            self.c.id,
            self.c.token,
            seq,
            &StepChange::Retryable {
                class: class.as_str(),
                message: &message,
                at,
                count_attempt,
                reason: &reason,
            },
        )
        .await?;
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
        store::fence(&mut tx, &self.sh.schema, self.c.id, self.c.token).await?;
        store::change_step(
            &mut *tx,
            &self.sh.schema,
            self.c.id,
            self.c.token,
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
    /// undo. Returns the change made.
    async fn begin_compensation(
        &mut self,
        tx: &mut sqlx::PgConnection,
        reason: &str,
    ) -> Result<ProcessChange, WriteError> {
        let mut comps = Vec::new();
        for s in self.steps.iter().rev() {
            if s.role != Role::Forward || s.status != StepStatus::Succeeded {
                continue;
            }
            if self
                .steps
                .iter()
                .any(|o| o.role == Role::Compensation && o.acts_on == Some(s.seq))
            {
                continue;
            }
            if let Some(c) = self
                .def
                .step_named(&s.name)
                .and_then(|d| d.compensation.as_ref())
            {
                comps.push(store::NewCompensation {
                    acts_on: s.seq,
                    name: s.name.clone(),
                    execution: c.action.execution(),
                    remote: c.action.remote().map(|r| r.as_str()),
                    sensitive: c.sensitive,
                    max_attempts: c.retry.max_attempts.max(1),
                    label: c.label.clone(),
                });
            }
        }
        let has_existing = self.steps.iter().any(|o| o.role == Role::Compensation);
        if comps.is_empty() && !has_existing {
            store::change_process(
                tx,
                &self.sh.schema,
                self.c.id,
                self.c.token,
                ProcessChange::Failed,
                reason,
            )
            .await?;
            return Ok(ProcessChange::Failed);
        }
        store::add_compensations(tx, &self.sh.schema, self.c.id, self.c.token, &comps, reason)
            .await?;
        store::change_process(
            tx,
            &self.sh.schema,
            self.c.id,
            self.c.token,
            ProcessChange::Compensating,
            reason,
        )
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
        self.steps = store::steps(&mut conn, &self.sh.schema, self.c.id).await?;
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
        store::fence(&mut tx, &self.sh.schema, self.c.id, self.c.token).await?;
        if self.steps[i].status != StepStatus::ManualReview {
            store::change_step(
                &mut *tx,
                &self.sh.schema,
                self.c.id,
                self.c.token,
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
        store::change_process(
            &mut tx,
            &self.sh.schema,
            self.c.id,
            self.c.token,
            ProcessChange::ManualReview,
            reason,
        )
        .await?;
        tx.commit().await?;
        self.put(conn);
        self.steps[i].status = StepStatus::ManualReview;
        tracing::warn!(process = %self.c.id, kind = %self.c.kind, step = %self.steps[i].name, reason, "process needs manual review");
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

/// The previous attempt may have acted: its worker died mid-call, or it ended without an answer.
fn in_doubt(s: &StepRow) -> bool {
    s.status == StepStatus::Running
        || (s.status == StepStatus::Retryable && s.error_class.as_deref() == Some("unknown"))
}
