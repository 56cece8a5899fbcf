//! A turn's dealings with a step's dependency (`breaker`): may the call go now
//! ([`Run::admit`]), what its answer said of the remote's health ([`Run::record_health`]), and the
//! wait of a step whose remote is unavailable or whose circuit keeps calls back
//! ([`Run::wait_unavailable`]): no attempt spent, only the business deadline ends it.

use super::{CallOutcome, External, Run, TurnEnd};
use crate::decide;
use crate::error::{ErrorClass, StepError};
use crate::internal_events as events;
use crate::redact;
use crate::status::StepStatus;
use crate::store::{Fenced, StepChange, WriteError};
use breaker::{Admission, Outcome as Health};
use chrono::{DateTime, Utc};
use std::ops::ControlFlow;
use std::time::Duration;

/// What a step that cannot call its remote now waits for.
pub(super) struct Unavailable<'m> {
    /// What the remote said, or why the circuit would not let the call go.
    pub(super) message: &'m str,
    pub(super) retry_after: Option<Duration>,
    /// The dependency whose wake-up it waits for (the circuit said wait), if any.
    pub(super) waiting_for: Option<&'m str>,
    /// No earlier than this (the circuit's or the limit's time).
    pub(super) not_before: Option<DateTime<Utc>>,
    /// The refused call began an attempt, which is given back.
    pub(super) uncount: bool,
}

/// How long a step waiting for a dependency's wake-up sleeps at most (spread over 80-100% of it)
/// before it is claimed on its own timer, only to look at its deadline: it calls the remote only
/// when the wake-up (which runs in every worker) resumes it, so the resume rate holds. Long,
/// because every self-claim costs a claim: with a one-minute timer that also called, 16,199 steps
/// waiting out a twenty-minute outage resumed at 147/s against a resume rate of 50.
const DEPENDENCY_RECHECK: Duration = Duration::from_secs(15 * 60);
/// A limit's wait shorter than this is slept in the turn (the process keeps its lease); a longer
/// one parks the process.
const SHORT_WAIT: Duration = Duration::from_secs(1);

impl Run<'_> {
    /// Asks step `i`'s dependency (if it names one) whether the call may go now: a permit is
    /// kept for the call; a short wait for a limit is slept; a circuit that says wait, or a long
    /// wait, parks the step ([`Self::wait_unavailable`]) without spending an attempt.
    pub(super) async fn admit(
        &mut self,
        i: usize,
        ext: &External,
    ) -> Result<ControlFlow<Option<TurnEnd>>, WriteError> {
        if let Some(p) = self.permit.take() {
            p.cancel().await;
        }
        let Some(dep) = &ext.dependency else {
            return Ok(ControlFlow::Continue(()));
        };
        // Claimed on its own timer, not woken: the wake-up resumes the waiting steps oldest first
        // at the dependency's rate, and this one takes its turn there (or fails at its deadline).
        if self.steps[i].waiting_for.is_some() {
            let why = format!(
                "waiting for {}: its waiting steps resume oldest first, at most {} a second",
                dep.name(),
                dep.policy().resume_per_second
            );
            let w = Unavailable {
                message: &why,
                retry_after: None,
                waiting_for: Some(dep.name()),
                not_before: None,
                uncount: false,
            };
            return Ok(ControlFlow::Break(self.wait_unavailable(i, ext, w).await?));
        }
        let lease = ext.timeout + Duration::from_secs(5);
        let schema = self.c.lease.schema().clone();
        for _ in 0..10 {
            let wait = match dep.acquire(&self.sh.breaker_pool, &schema, lease).await? {
                Admission::Go(permit) => {
                    self.permit = Some(permit);
                    return Ok(ControlFlow::Continue(()));
                }
                Admission::Wait(w) => w,
            };
            let circuit = !matches!(
                wait.reason,
                breaker::WaitReason::RateLimited | breaker::WaitReason::Saturated
            );
            if !circuit && wait.remaining() < SHORT_WAIT {
                tokio::select! {
                    _ = tokio::time::sleep(wait.remaining()) => continue,
                    _ = self.lost.cancelled() => return Err(Fenced.into()),
                }
            }
            let why = format!("waiting for {}: {}", dep.name(), wait.reason.describe());
            events::dependency_wait(&self.c.kind, dep.name(), wait.reason.as_str());
            let w = Unavailable {
                message: &why,
                retry_after: None,
                waiting_for: circuit.then(|| dep.name()),
                not_before: Some(wait.until),
                uncount: false,
            };
            return Ok(ControlFlow::Break(self.wait_unavailable(i, ext, w).await?));
        }
        let why = format!(
            "waiting for {}: its limits refused ten times in a row",
            dep.name()
        );
        let w = Unavailable {
            message: &why,
            retry_after: None,
            waiting_for: None,
            not_before: None,
            uncount: false,
        };
        Ok(ControlFlow::Break(self.wait_unavailable(i, ext, w).await?))
    }

    /// Tells the dependency (if the call had a permit) what the remote's answer said of its
    /// health.
    pub(super) async fn record_health(&mut self, health: Health) {
        if let Some(p) = self.permit.take() {
            p.record(health).await;
        }
    }

    /// The remote was unavailable, or its dependency's circuit or limits would not let the call
    /// go: the step waits, without spending an attempt, until its dependency wakes it or its own
    /// backoff ends ([`RetryPolicy::unavailable_delay`]); never past its policy's deadline (the
    /// business deadline), which ends the wait as a failure (or, in doubt, in review). A step in
    /// doubt stays in doubt (stored `unknown`).
    pub(super) async fn wait_unavailable(
        &mut self,
        i: usize,
        ext: &External,
        w: Unavailable<'_>,
    ) -> Result<Option<TurnEnd>, WriteError> {
        let now = Utc::now();
        let s = &self.steps[i];
        let first = s.first_attempt_at.unwrap_or(now);
        let deadline = ext.retry.deadline.map(|d| decide::later(first, d));
        let message = redact::message(w.message);
        if deadline.is_some_and(|d| d <= now) {
            let why = format!("deadline passed while the remote was unavailable: {message}");
            if ext.doubt {
                let reason = format!(
                    "{why}; the outcome of an earlier attempt of {} is unknown",
                    s.name
                );
                self.review(i, Some(ErrorClass::Unknown), Some(&why), false, &reason)
                    .await?;
                return Ok(Some(TurnEnd::Parked));
            }
            return self.fail(i, StepError::unavailable(why), false).await;
        }
        let own = match w.waiting_for {
            Some(_) => {
                use rand::Rng;
                DEPENDENCY_RECHECK.mul_f64(rand::rng().random_range(0.8..=1.0))
            }
            None => {
                let waited = s
                    .waiting_since
                    .and_then(|t| (now - t).to_std().ok())
                    .unwrap_or_default();
                ext.retry.unavailable_delay(waited, w.retry_after)
            }
        };
        let mut at = decide::later(now, own);
        if let Some(nb) = w.not_before
            && nb > at
        {
            at = nb;
        }
        if let Some(d) = deadline {
            at = at.min(d);
        }
        let (class, message) = if ext.doubt {
            let m = format!("{message}; the outcome of an earlier attempt is still unknown");
            (ErrorClass::Unknown, m)
        } else {
            (ErrorClass::Unavailable, message)
        };
        let reason = format!(
            "{message}; no attempt spent, looks again by {}",
            at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        );
        let seq = s.seq;
        let mut conn = self.take().await?;
        let change = StepChange::Waiting {
            class: class.as_str(),
            message: &message,
            at,
            waiting_for: w.waiting_for,
            uncount: w.uncount,
            reason: &reason,
        };
        self.c.lease.change_step(&mut *conn, seq, &change).await?;
        self.put(conn);
        events::step_attempt(
            &self.c.kind,
            &self.steps[i].name,
            "waiting",
            ErrorClass::Unavailable.as_str(),
            ext.started.elapsed(),
        );
        let s = &mut self.steps[i];
        s.status = StepStatus::Retryable;
        s.waiting_for = w.waiting_for.map(str::to_string);
        s.attempts -= i32::from(w.uncount);
        s.next_attempt_at = Some(at);
        s.error_class = Some(class.as_str().into());
        s.first_attempt_at.get_or_insert(now);
        s.waiting_since.get_or_insert(now);
        Ok(None)
    }
}

/// What a call's outcome says of its remote's health: an answer (a success, or a refusal that
/// decides something) shows it up; "unavailable" shows it down; no answer (a timeout after
/// sending, an unknown outcome) or a transient error says neither.
pub(super) fn health(outcome: &CallOutcome) -> Health {
    match outcome {
        Ok(Ok(_)) => Health::Answered,
        Ok(Err(e)) => match e.class {
            ErrorClass::Permanent => Health::Answered,
            ErrorClass::Unavailable => health_of_unavailable(e),
            ErrorClass::Transient | ErrorClass::Unknown => Health::NoAnswer,
        },
        Err(_) => Health::NoAnswer,
    }
}

pub(super) fn health_of_unavailable(e: &StepError) -> Health {
    Health::Unavailable {
        retry_after: e.retry_after,
        message: redact::message(&e.message),
    }
}

/// The step's dependency, if this unavailable answer left its circuit not letting calls go (the
/// step then waits for the circuit's wake-up); `None` while it still lets calls go (the step
/// waits out its own backoff and the remote's `Retry-After`).
pub(super) fn circuit_stopped(ext: &External) -> Option<&str> {
    let dep = ext.dependency.as_ref()?;
    let stopped = dep.last_seen().is_some_and(|c| !c.lets_through());
    stopped.then(|| dep.name())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::definition::Done;

    #[tokio::test]
    async fn only_an_unavailable_answer_counts_against_the_remote_and_a_timeout_never_does() {
        let answered: CallOutcome = Ok(Ok(Done::new("ref")));
        assert_eq!(health(&answered), Health::Answered);
        let declined: CallOutcome = Ok(Err(StepError::permanent("402 declined")));
        assert_eq!(
            health(&declined),
            Health::Answered,
            "a refusal is an answer"
        );
        let down: CallOutcome = Ok(Err(
            StepError::unavailable("503").retry_after(Some(Duration::from_secs(7)))
        ));
        assert_eq!(
            health(&down),
            Health::Unavailable {
                retry_after: Some(Duration::from_secs(7)),
                message: "503".into()
            }
        );
        for neither in [
            StepError::unknown("reset after sending"),
            StepError::transient("502"),
        ] {
            assert_eq!(health(&Ok(Err(neither))), Health::NoAnswer);
        }
        let timed_out: CallOutcome =
            tokio::time::timeout(Duration::ZERO, std::future::pending()).await;
        assert_eq!(
            health(&timed_out),
            Health::NoAnswer,
            "a timeout after sending"
        );
    }
}
