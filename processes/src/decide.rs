//! The decisions over step rows, pure: no database, no clock of their own (`now` is given), no
//! definition (what a definition says about a step is given as a function). The runner and the
//! operators' views ([`crate::admin`]) decide here and act elsewhere, so each rule is written
//! once and tested over plain rows beside it.
//!
//! - For a worker's turn ([`StepRow`]): the next step ([`next`]), whether a step is in doubt
//!   ([`in_doubt`]), the steps one local transaction runs ([`local_group`]), what an error leads
//!   to ([`after_error`]) and whether a step's budget is spent ([`budget_spent`]), the
//!   compensation plan ([`compensation_plan`]).
//! - For operators ([`StepView`]): the actions allowed now ([`allowed_actions`]), what an action
//!   needs ([`requirements`]) and the steps in doubt ([`doubts`]).

use crate::admin::{Action, Doubt, ProcessSummary, Requirements, StepView};
use crate::definition::{Remote, Role};
use crate::error::{ErrorClass, StepError};
use crate::retry::RetryPolicy;
use crate::status::{ProcessStatus, StepStatus};
use crate::store::{ProcessChange, StepRow};
use chrono::{DateTime, TimeDelta, Utc};

/// Which steps a turn runs: the forward steps, or (after a failure) the compensations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Forward,
    Compensating,
}

impl Phase {
    /// The phase a claimed process with `status` is in.
    pub fn of(status: ProcessStatus) -> Self {
        if status == ProcessStatus::Compensating {
            Phase::Compensating
        } else {
            Phase::Forward
        }
    }

    /// The role of the steps this phase runs.
    pub fn role(self) -> Role {
        match self {
            Phase::Forward => Role::Forward,
            Phase::Compensating => Role::Compensation,
        }
    }

    /// How the process ends when every step of the phase succeeded, and why.
    pub fn end(self) -> (ProcessChange, &'static str) {
        match self {
            Phase::Forward => (ProcessChange::Succeeded, "every step succeeded"),
            Phase::Compensating => (ProcessChange::Compensated, "every compensation succeeded"),
        }
    }
}

/// The step to run, or what the process does instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    Run(usize),
    Wait(DateTime<Utc>),
    Finish(ProcessChange, String),
    Review(usize, String),
    /// A forward step failed (an operator resolved it so), or the deadline passed: compensate.
    Compensate(String),
}

/// What the process does next, from its steps in `phase`, its deadline and `now`. `parks(i)`:
/// step `i` is a wait or timer, which decides itself whether it is due (a signal may have woken
/// it before its backoff or deadline).
pub(crate) fn next(
    steps: &[StepRow],
    phase: Phase,
    deadline: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    parks: impl Fn(usize) -> bool,
) -> Next {
    let role = phase.role();
    let Some(i) = steps
        .iter()
        .position(|s| s.role == role && s.status != StepStatus::Succeeded)
    else {
        let (change, why) = phase.end();
        return Next::Finish(change, why.into());
    };
    let s = &steps[i];
    match (phase, s.status) {
        (Phase::Forward, StepStatus::Failed) => Next::Compensate(format!("step {} failed", s.name)),
        (Phase::Compensating, StepStatus::Failed) => {
            Next::Review(i, format!("compensation of {} failed", s.name))
        }
        (_, StepStatus::ManualReview) => Next::Finish(
            ProcessChange::ManualReview,
            format!("step {} needs a decision (manual review)", s.name),
        ),
        _ if phase == Phase::Forward && deadline.is_some_and(|d| d <= now) => {
            if in_doubt(s) {
                return Next::Review(
                    i,
                    format!(
                        "process deadline passed with the outcome of {} unknown",
                        s.name
                    ),
                );
            }
            Next::Compensate(format!(
                "process deadline passed before {} succeeded",
                s.name
            ))
        }
        _ if parks(i) => Next::Run(i),
        _ => match s.next_attempt_at {
            Some(at) if s.status == StepStatus::Retryable && at > now => Next::Wait(at),
            _ => Next::Run(i),
        },
    }
}

/// The previous attempt may have acted: its worker died mid-call, or it ended without an answer.
pub(crate) fn in_doubt(s: &StepRow) -> bool {
    s.status == StepStatus::Running
        || (s.status == StepStatus::Retryable
            && s.error_class.as_deref() == Some(ErrorClass::Unknown.as_str()))
}

/// Step `i` is the last of its phase still to succeed (so its checkpoint can finish the process).
pub(crate) fn is_last(steps: &[StepRow], i: usize) -> bool {
    let role = steps[i].role;
    !steps
        .iter()
        .enumerate()
        .any(|(j, s)| j != i && s.role == role && s.status != StepStatus::Succeeded)
}

/// Every step of `role` succeeded.
pub(crate) fn all_succeeded(steps: &[StepRow], role: Role) -> bool {
    !steps
        .iter()
        .any(|s| s.role == role && s.status != StepStatus::Succeeded)
}

/// The local steps one transaction runs, from step `i` (which the caller found due): `i` and the
/// steps of its role after it that are local (`local(j)`) and due now, at most `max` of them,
/// skipping those that succeeded, stopping at the first other one. Past the process deadline a
/// forward step runs alone (the next one is compensated instead).
pub(crate) fn local_group(
    steps: &[StepRow],
    i: usize,
    max: usize,
    phase: Phase,
    deadline: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
    local: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let role = steps[i].role;
    let past_deadline = phase == Phase::Forward && deadline.is_some_and(|d| d <= now);
    let mut group = vec![i];
    for (j, s) in steps.iter().enumerate().skip(i + 1) {
        if group.len() >= max.max(1) || past_deadline {
            break;
        }
        if s.role != role || s.status == StepStatus::Succeeded {
            continue;
        }
        let due = s.status == StepStatus::Pending
            || (s.status == StepStatus::Retryable && s.next_attempt_at.is_none_or(|at| at <= now));
        if !(due && local(j)) {
            break;
        }
        group.push(j);
    }
    group
}

/// `d` after `at`, or the last representable time when that overflows: a definition may set a
/// deadline or a delay of any length (`Duration::MAX` for "never"), and adding it must not panic
/// the turn (the lease would expire and the next claim panic again, for ever).
pub(crate) fn later(at: DateTime<Utc>, d: std::time::Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// Why a step may not be tried again (`None`: it may): `attempts` made of `max_attempts`, or the
/// policy's deadline after the first attempt passed by `at`.
pub(crate) fn budget_spent(
    attempts: i32,
    max_attempts: i32,
    first_attempt_at: Option<DateTime<Utc>>,
    deadline: Option<std::time::Duration>,
    at: DateTime<Utc>,
) -> Option<&'static str> {
    let past_deadline = deadline
        .zip(first_attempt_at)
        .is_some_and(|(d, first)| later(first, d) <= at);
    if past_deadline {
        Some("deadline passed")
    } else if attempts >= max_attempts {
        Some("attempts exhausted")
    } else {
        None
    }
}

/// What a failed attempt of a step leads to ([`after_error`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AfterError {
    /// A person decides; `unknown_outcome`: because the remote may have acted and offers no way
    /// to find out.
    Review {
        reason: String,
        unknown_outcome: bool,
    },
    /// The step fails for good (a forward step then compensates).
    Fail(StepError),
    /// Tried again at `at`, after `attempts` attempts.
    Retry { at: DateTime<Utc>, attempts: i32 },
}

/// What an error of class `class` (its message already redacted) on step `s` leads to, by class,
/// remote and budget: an unknown outcome never becomes a failure (it may have happened), a
/// permanent error fails at once, a spent budget fails (or, for an unknown outcome or a
/// compensation, goes to review), anything else is retried after the policy's backoff.
/// `count_attempt`: this error ends an attempt not counted yet.
pub(crate) fn after_error(
    s: &StepRow,
    class: ErrorClass,
    message: &str,
    count_attempt: bool,
    retry: &RetryPolicy,
    now: DateTime<Utc>,
) -> AfterError {
    let attempts = s.attempts + i32::from(count_attempt);
    if class == ErrorClass::Unknown && s.remote == Some(Remote::Neither) {
        let reason = format!(
            "outcome of {} unknown ({message}) and the remote offers neither key nor query",
            s.name
        );
        return AfterError::Review {
            reason,
            unknown_outcome: true,
        };
    }
    if class == ErrorClass::Permanent {
        return AfterError::Fail(StepError::permanent(message));
    }
    let at = later(now, retry.delay_after(attempts));
    let first = s.first_attempt_at.unwrap_or(now);
    match budget_spent(attempts, s.max_attempts, Some(first), retry.deadline, at) {
        Some(why) if class == ErrorClass::Unknown || s.role == Role::Compensation => {
            AfterError::Review {
                reason: format!("{why} ({attempts} attempts) for {}: {message}", s.name),
                unknown_outcome: false,
            }
        }
        Some(why) => AfterError::Fail(StepError::new(
            class,
            format!("{why} after {attempts} attempts: {message}"),
        )),
        None => AfterError::Retry { at, attempts },
    }
}

/// The plan when a process starts compensating ([`compensation_plan`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Undo<'s> {
    /// Nothing succeeded that can be undone: the process fails.
    Nothing,
    /// Compensate: these forward steps get a compensation, in the order they run (possibly
    /// none new, when compensations were added before).
    Compensate(Vec<&'s StepRow>),
}

/// The compensations to add: for each forward step that succeeded, last first, that has a
/// compensation in its definition (`compensable`) and none yet.
pub(crate) fn compensation_plan<'s>(
    steps: &'s [StepRow],
    compensable: impl Fn(&StepRow) -> bool,
) -> Undo<'s> {
    let has_compensation = |seq: i32| {
        steps
            .iter()
            .any(|o| o.role == Role::Compensation && o.acts_on == Some(seq))
    };
    let plan: Vec<&StepRow> = steps
        .iter()
        .rev()
        .filter(|s| s.role == Role::Forward && s.status == StepStatus::Succeeded)
        .filter(|s| !has_compensation(s.seq) && compensable(s))
        .collect();
    if plan.is_empty() && !steps.iter().any(|o| o.role == Role::Compensation) {
        return Undo::Nothing;
    }
    Undo::Compensate(plan)
}

/// Whether the remote may have acted on `s` with nobody knowing the outcome: an external step in
/// manual review whose last outcome is unknown, or a wait step still waiting for its event (the
/// call it waits on was made; its answer has not come).
fn doubtful(s: &StepView) -> bool {
    (s.status == StepStatus::ManualReview
        && matches!(s.execution.as_str(), "external" | "wait")
        && s.error_class.as_deref() == Some(ErrorClass::Unknown.as_str()))
        || s.is_waiting()
}

/// What `action` needs on a process with `steps`, as they are now.
pub fn requirements(action: &Action, steps: &[StepView]) -> Requirements {
    let doubt = action
        .seq()
        .and_then(|seq| steps.iter().find(|s| s.seq == seq))
        .is_some_and(doubtful);
    match action {
        Action::ResolveSucceeded { .. } => Requirements {
            evidence: true,
            remote_check: false,
            second_person: true,
        },
        Action::ResolveFailed { .. } if doubt => Requirements {
            evidence: false,
            remote_check: true,
            second_person: true,
        },
        Action::RunCompensation { .. } => Requirements {
            second_person: true,
            ..Requirements::default()
        },
        _ => Requirements::default(),
    }
}

/// The doubts among `steps` (see [`Doubt`]).
pub fn doubts(steps: &[StepView]) -> Vec<Doubt> {
    steps
        .iter()
        .filter(|s| doubtful(s))
        .map(|s| {
            let remote = s.remote.as_deref().and_then(Remote::parse);
            let (safe_action, how) = match remote {
                _ if s.is_waiting() => (
                    (remote == Some(Remote::Queryable)).then_some(Action::QueryRemote { seq: s.seq }),
                    "it waits for the remote's event: let it wait (at the deadline the remote is \
                     queried, or the step goes to manual review), or query the remote now where it \
                     can be queried",
                ),
                Some(Remote::HonoursKey) => (
                    Some(Action::RerunStep { seq: s.seq }),
                    "rerun it: the remote deduplicates by the same key, so it cannot act twice and \
                     its answer settles the outcome",
                ),
                Some(Remote::Queryable) => (
                    Some(Action::QueryRemote { seq: s.seq }),
                    "query its status: a worker asks the remote by operation id before any new call",
                ),
                _ => (
                    None,
                    "the remote can neither deduplicate nor be queried: look it up at the remote \
                     (operation id, reference) and record what you checked and its answer",
                ),
            };
            Doubt {
                seq: s.seq,
                name: s.name.clone(),
                remote: s.remote.clone(),
                warning: format!(
                    "the outcome of {} is unknown: the remote may have acted. Resolving it as failed \
                     without checking can leave the effect in place with nothing to undo it \
                     (a charge kept, never refunded); {how}. Resolving it needs what was checked at \
                     the remote and its answer, and a second approver.",
                    s.name
                ),
                safe_action,
            }
        })
        .collect()
}

/// The actions allowed now, from the process status, each step's status, error class and remote
/// capability. There is no "retry everything". The step actions come first, and for each step the
/// safe ones (rerun with the same key, query the remote) before the resolutions, resolving as
/// failed last.
pub fn allowed_actions(p: &ProcessSummary, steps: &[StepView]) -> Vec<Action> {
    let mut out = Vec::new();
    if p.status.is_terminal() {
        return out;
    }
    if p.status == ProcessStatus::ManualReview {
        for s in steps
            .iter()
            .filter(|s| s.status == StepStatus::ManualReview)
        {
            let remote = s.remote.as_deref().and_then(Remote::parse);
            let role = Role::parse(&s.role);
            let in_doubt = s.error_class.as_deref() == Some("unknown");
            match role {
                Some(Role::Compensation) => out.push(Action::RunCompensation { seq: s.seq }),
                Some(Role::Forward) => {
                    let idempotent = s.execution == "local" || remote == Some(Remote::HonoursKey);
                    if idempotent || !in_doubt {
                        out.push(Action::RerunStep { seq: s.seq });
                    }
                    if remote == Some(Remote::Queryable) {
                        out.push(Action::QueryRemote { seq: s.seq });
                    }
                }
                _ => {}
            }
            out.push(Action::ResolveSucceeded { seq: s.seq });
            out.push(Action::ResolveFailed { seq: s.seq });
        }
    }
    if p.status == ProcessStatus::Waiting {
        // A parked wait: query the remote now rather than at the deadline, or decide with the
        // evidence a person has (as for a step in doubt: the remote may have acted).
        for s in steps.iter().filter(|s| s.is_waiting()) {
            if s.remote.as_deref().and_then(Remote::parse) == Some(Remote::Queryable) {
                out.push(Action::QueryRemote { seq: s.seq });
            }
            out.push(Action::ResolveSucceeded { seq: s.seq });
            out.push(Action::ResolveFailed { seq: s.seq });
        }
    }
    if p.status != ProcessStatus::ManualReview {
        out.push(Action::Escalate);
    }
    out.push(if p.paused {
        Action::Resume
    } else {
        Action::Pause
    });
    if matches!(
        p.status,
        ProcessStatus::Pending
            | ProcessStatus::Running
            | ProcessStatus::Waiting
            | ProcessStatus::ManualReview
    ) {
        out.push(Action::Cancel);
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::admin::Action;
    use uuid::Uuid;

    #[test]
    fn a_deadline_or_delay_of_any_length_never_overflows() {
        let now = Utc::now();
        assert_eq!(
            later(now, std::time::Duration::MAX),
            DateTime::<Utc>::MAX_UTC
        );
        assert_eq!(
            later(now, std::time::Duration::from_secs(60)),
            now + TimeDelta::seconds(60)
        );
        assert_eq!(
            budget_spent(1, 5, Some(now), Some(std::time::Duration::MAX), now),
            None,
            "a deadline that never comes is never passed"
        );
    }

    fn row(seq: i32, role: Role, status: StepStatus) -> StepRow {
        StepRow {
            seq,
            name: format!("s{seq}"),
            role,
            acts_on: None,
            remote: None,
            status,
            operation_id: Uuid::nil(),
            attempts: 0,
            max_attempts: 3,
            next_attempt_at: None,
            first_attempt_at: None,
            error_class: None,
            remote_ref: None,
            result_ref: None,
            output: None,
            wait_key: None,
            wait_until: None,
            waiting_since: None,
            waiting_for: None,
        }
    }

    fn fwd(seq: i32, status: StepStatus) -> StepRow {
        row(seq, Role::Forward, status)
    }

    fn comp(seq: i32, acts_on: i32, status: StepStatus) -> StepRow {
        StepRow {
            acts_on: Some(acts_on),
            ..row(seq, Role::Compensation, status)
        }
    }

    fn retryable(seq: i32, class: ErrorClass, at: DateTime<Utc>) -> StepRow {
        StepRow {
            error_class: Some(class.as_str().into()),
            next_attempt_at: Some(at),
            attempts: 1,
            ..fwd(seq, StepStatus::Retryable)
        }
    }

    fn no_park(_: usize) -> bool {
        false
    }

    use StepStatus::{Failed, ManualReview, Pending, Running, Succeeded};

    #[test]
    fn next_runs_the_first_step_of_the_phase_not_succeeded() {
        let now = Utc::now();
        let steps = [fwd(1, Succeeded), fwd(2, Pending), fwd(3, Pending)];
        assert_eq!(
            next(&steps, Phase::Forward, None, now, no_park),
            Next::Run(1)
        );
        // In the compensating phase only compensations count, the forward rows are history.
        let steps = [fwd(1, Succeeded), fwd(2, Failed), comp(3, 1, Pending)];
        let n = next(&steps, Phase::Compensating, None, now, no_park);
        assert_eq!(n, Next::Run(2));
    }

    #[test]
    fn next_finishes_the_phase_when_every_step_of_it_succeeded() {
        let now = Utc::now();
        let steps = [fwd(1, Succeeded), fwd(2, Succeeded)];
        assert!(matches!(
            next(&steps, Phase::Forward, None, now, no_park),
            Next::Finish(ProcessChange::Succeeded, _)
        ));
        let steps = [fwd(1, Succeeded), fwd(2, Failed), comp(3, 1, Succeeded)];
        assert!(matches!(
            next(&steps, Phase::Compensating, None, now, no_park),
            Next::Finish(ProcessChange::Compensated, _)
        ));
    }

    #[test]
    fn next_after_a_failure_compensates_a_forward_step_and_reviews_a_compensation() {
        let now = Utc::now();
        let steps = [fwd(1, Succeeded), fwd(2, Failed), fwd(3, Pending)];
        let n = next(&steps, Phase::Forward, None, now, no_park);
        assert!(
            matches!(&n, Next::Compensate(why) if why.contains("s2")),
            "{n:?}"
        );
        let steps = [fwd(1, Succeeded), fwd(2, Failed), comp(3, 1, Failed)];
        let n = next(&steps, Phase::Compensating, None, now, no_park);
        assert!(
            matches!(&n, Next::Review(2, why) if why.contains("s3")),
            "{n:?}"
        );
    }

    #[test]
    fn next_stops_at_a_step_in_manual_review() {
        let steps = [fwd(1, Succeeded), fwd(2, ManualReview), fwd(3, Pending)];
        let n = next(&steps, Phase::Forward, None, Utc::now(), no_park);
        assert!(
            matches!(n, Next::Finish(ProcessChange::ManualReview, _)),
            "{n:?}"
        );
    }

    /// A retryable step waits for its backoff, unless it is a wait or timer (which decides itself:
    /// a signal may have come); once due, it runs.
    #[test]
    fn next_backs_off_a_retryable_step_until_it_is_due() {
        let now = Utc::now();
        let later = now + TimeDelta::seconds(30);
        let steps = [retryable(1, ErrorClass::Transient, later)];
        assert_eq!(
            next(&steps, Phase::Forward, None, now, no_park),
            Next::Wait(later)
        );
        assert_eq!(
            next(&steps, Phase::Forward, None, now, |_| true),
            Next::Run(0)
        );
        let due = [retryable(
            1,
            ErrorClass::Transient,
            now - TimeDelta::seconds(1),
        )];
        assert_eq!(next(&due, Phase::Forward, None, now, no_park), Next::Run(0));
    }

    /// Past the process deadline a forward step is compensated, unless its outcome is unknown
    /// (then a person decides); compensations still run.
    #[test]
    fn next_past_the_deadline_compensates_or_reviews_an_unknown_outcome() {
        let now = Utc::now();
        let past = Some(now - TimeDelta::seconds(1));
        let steps = [fwd(1, Succeeded), fwd(2, Pending)];
        let n = next(&steps, Phase::Forward, past, now, no_park);
        assert!(
            matches!(&n, Next::Compensate(why) if why.contains("deadline")),
            "{n:?}"
        );
        let unknown = [fwd(1, Succeeded), retryable(2, ErrorClass::Unknown, now)];
        let n = next(&unknown, Phase::Forward, past, now, no_park);
        assert!(
            matches!(&n, Next::Review(1, why) if why.contains("unknown")),
            "{n:?}"
        );
        let steps = [fwd(1, Succeeded), fwd(2, Failed), comp(3, 1, Pending)];
        let n = next(&steps, Phase::Compensating, past, now, no_park);
        assert_eq!(n, Next::Run(2));
    }

    #[test]
    fn a_step_is_in_doubt_while_running_or_after_an_unknown_outcome() {
        let now = Utc::now();
        assert!(in_doubt(&fwd(1, Running)));
        assert!(in_doubt(&retryable(1, ErrorClass::Unknown, now)));
        assert!(!in_doubt(&retryable(1, ErrorClass::Transient, now)));
        assert!(!in_doubt(&fwd(1, Pending)));
        assert!(!in_doubt(&fwd(1, ManualReview)));
    }

    #[test]
    fn the_last_step_of_a_phase_is_the_only_one_not_succeeded() {
        let steps = [fwd(1, Succeeded), fwd(2, Pending), comp(3, 1, Pending)];
        assert!(is_last(&steps, 1));
        assert!(!all_succeeded(&steps, Role::Forward));
        let steps = [fwd(1, Pending), fwd(2, Pending)];
        assert!(!is_last(&steps, 0));
        assert!(all_succeeded(&[fwd(1, Succeeded)], Role::Forward));
    }

    /// A local group: the due local steps after the first, skipping succeeded ones, at most `max`,
    /// ending at the first step that is not local or not due, and only the first past the
    /// deadline.
    #[test]
    fn a_local_group_takes_the_due_local_steps_that_follow() {
        let now = Utc::now();
        let later = now + TimeDelta::seconds(30);
        let steps = [
            fwd(1, Pending),
            fwd(2, Succeeded),
            fwd(3, Pending),
            retryable(4, ErrorClass::Transient, now - TimeDelta::seconds(1)),
            fwd(5, Pending),
            fwd(6, Pending),
        ];
        let all = |_| true;
        let group = |max, deadline| local_group(&steps, 0, max, Phase::Forward, deadline, now, all);
        assert_eq!(group(8, None), vec![0, 2, 3, 4, 5]);
        assert_eq!(group(3, None), vec![0, 2, 3]);
        assert_eq!(
            group(0, None),
            vec![0],
            "a group has at least its first step"
        );
        assert_eq!(
            group(8, Some(now)),
            vec![0],
            "past the deadline a step runs alone"
        );
        let external_at_5 = |j| j != 4;
        let g = local_group(&steps, 0, 8, Phase::Forward, None, now, external_at_5);
        assert_eq!(g, vec![0, 2, 3]);
        let backing_off = [fwd(1, Pending), retryable(2, ErrorClass::Transient, later)];
        let g = local_group(&backing_off, 0, 8, Phase::Forward, None, now, all);
        assert_eq!(g, vec![0]);
        let other_role = [comp(3, 1, Pending), fwd(4, Pending), comp(5, 1, Pending)];
        let g = local_group(&other_role, 0, 8, Phase::Compensating, None, now, all);
        assert_eq!(g, vec![0, 2], "steps of the other role are skipped");
    }

    fn policy(max_attempts: i32, deadline: Option<std::time::Duration>) -> RetryPolicy {
        RetryPolicy {
            jitter: false,
            max_attempts,
            deadline,
            ..RetryPolicy::default()
        }
    }

    /// After an error: an unknown outcome at a remote that offers neither key nor query is a
    /// person's decision, a permanent error fails, a transient one is retried after the backoff.
    #[test]
    fn after_an_error_the_class_and_the_remote_decide() {
        let now = Utc::now();
        let retry = policy(3, None);
        let neither = StepRow {
            remote: Some(Remote::Neither),
            ..fwd(1, Running)
        };
        let a = after_error(&neither, ErrorClass::Unknown, "timeout", false, &retry, now);
        assert!(
            matches!(&a, AfterError::Review { unknown_outcome: true, reason } if reason.contains("neither")),
            "{a:?}"
        );
        let a = after_error(
            &fwd(1, Running),
            ErrorClass::Permanent,
            "no",
            false,
            &retry,
            now,
        );
        assert_eq!(a, AfterError::Fail(StepError::permanent("no")));
        let s = StepRow {
            attempts: 1,
            ..fwd(1, Running)
        };
        match after_error(&s, ErrorClass::Transient, "503", true, &retry, now) {
            AfterError::Retry { at, attempts } => {
                assert_eq!(attempts, 2, "the attempt that failed is counted");
                assert_eq!(at, now + TimeDelta::from_std(retry.delay_after(2)).unwrap());
            }
            other => panic!("{other:?}"),
        }
        // A queryable remote's unknown outcome is retried (the next attempt queries first).
        let queryable = StepRow {
            remote: Some(Remote::Queryable),
            ..s.clone()
        };
        let a = after_error(
            &queryable,
            ErrorClass::Unknown,
            "timeout",
            false,
            &retry,
            now,
        );
        assert!(matches!(a, AfterError::Retry { attempts: 1, .. }), "{a:?}");
    }

    /// Out of budget (the row's attempts, stored from the policy when the step was made): a
    /// transient error fails the step, an unknown outcome or a compensation goes to review (never
    /// a failure that would treat the remote as if it had not acted).
    #[test]
    fn after_an_error_a_spent_budget_fails_or_reviews() {
        let now = Utc::now();
        let retry = policy(2, None);
        let s = StepRow {
            attempts: 2,
            max_attempts: 2,
            ..fwd(1, Running)
        };
        let a = after_error(&s, ErrorClass::Transient, "503", false, &retry, now);
        assert!(
            matches!(&a, AfterError::Fail(e) if e.class == ErrorClass::Transient && e.message.contains("attempts exhausted")),
            "{a:?}"
        );
        let a = after_error(&s, ErrorClass::Unknown, "timeout", false, &retry, now);
        assert!(
            matches!(
                a,
                AfterError::Review {
                    unknown_outcome: false,
                    ..
                }
            ),
            "{a:?}"
        );
        let c = StepRow {
            attempts: 2,
            max_attempts: 2,
            ..comp(2, 1, Running)
        };
        let a = after_error(&c, ErrorClass::Transient, "503", false, &retry, now);
        assert!(matches!(a, AfterError::Review { .. }), "{a:?}");
        // The policy's deadline counts from the first attempt.
        let retry = policy(10, Some(std::time::Duration::from_secs(60)));
        let old = StepRow {
            attempts: 1,
            first_attempt_at: Some(now - TimeDelta::seconds(61)),
            ..fwd(1, Running)
        };
        let a = after_error(&old, ErrorClass::Transient, "503", false, &retry, now);
        assert!(
            matches!(&a, AfterError::Fail(e) if e.message.contains("deadline passed")),
            "{a:?}"
        );
    }

    #[test]
    fn the_budget_is_spent_by_attempts_or_by_the_deadline_first() {
        let now = Utc::now();
        let minute = Some(std::time::Duration::from_secs(60));
        let first = Some(now - TimeDelta::seconds(30));
        assert_eq!(budget_spent(1, 3, first, minute, now), None);
        assert_eq!(
            budget_spent(3, 3, first, minute, now),
            Some("attempts exhausted")
        );
        let at = now + TimeDelta::seconds(31);
        assert_eq!(
            budget_spent(3, 3, first, minute, at),
            Some("deadline passed")
        );
        assert_eq!(
            budget_spent(1, 3, None, minute, at),
            None,
            "not begun: no deadline yet"
        );
        assert_eq!(budget_spent(1, 3, first, None, at), None);
    }

    /// The compensation plan: the forward steps that succeeded, last first, only those whose
    /// definition has a compensation and that have none yet.
    #[test]
    fn the_compensation_plan_undoes_the_succeeded_steps_last_first() {
        let steps = [
            fwd(1, Succeeded),
            fwd(2, Succeeded),
            fwd(3, Succeeded),
            fwd(4, Failed),
            fwd(5, Pending),
        ];
        let without_2 = |s: &StepRow| s.seq != 2;
        let Undo::Compensate(plan) = compensation_plan(&steps, without_2) else {
            panic!("nothing to undo");
        };
        let seqs: Vec<i32> = plan.iter().map(|s| s.seq).collect();
        assert_eq!(seqs, vec![3, 1]);
        // Those compensated already are not added again; with compensations there, the process
        // compensates even with nothing new.
        let again = [fwd(1, Succeeded), fwd(2, Failed), comp(3, 1, Pending)];
        assert_eq!(
            compensation_plan(&again, |_| true),
            Undo::Compensate(vec![])
        );
        // Nothing succeeded, or nothing that can be undone: the process fails.
        let first_failed = [fwd(1, Failed), fwd(2, Pending)];
        assert_eq!(compensation_plan(&first_failed, |_| true), Undo::Nothing);
        let no_comp = [fwd(1, Succeeded), fwd(2, Failed)];
        assert_eq!(compensation_plan(&no_comp, |_| false), Undo::Nothing);
    }

    /// A process summary for tests over decisions (also used by `admin`'s tests).
    pub(crate) fn process(status: ProcessStatus, paused: bool) -> ProcessSummary {
        let now = Utc::now();
        ProcessSummary {
            id: Uuid::nil(),
            kind: "order".into(),
            definition_version: 1,
            business_key: "o-1".into(),
            revision: 0,
            revision_of: None,
            status,
            paused,
            attempt: 1,
            last_reason: String::new(),
            last_actor: "system".into(),
            created_at: now,
            updated_at: now,
            finished_at: None,
            deadline_at: None,
            lease_owner: None,
            lease_until: None,
            row_version: 1,
        }
    }

    /// A step as a view, for tests over decisions (also used by `admin`'s tests).
    pub(crate) fn view(seq: i32, role: Role, execution: &str, status: StepStatus) -> StepView {
        StepView {
            seq,
            name: format!("s{seq}"),
            role: role.as_str().into(),
            acts_on: None,
            execution: execution.into(),
            remote: None,
            sensitive: false,
            status,
            operation_id: Uuid::nil(),
            attempts: 1,
            max_attempts: 3,
            next_attempt_at: None,
            first_attempt_at: None,
            last_attempt_at: None,
            finished_at: None,
            error_class: None,
            error_message: None,
            remote_ref: None,
            result_ref: None,
            last_reason: String::new(),
            last_actor: "system".into(),
            wait_key: None,
            wait_since: None,
            wait_until: None,
            waiting_for: None,
            waiting_since: None,
        }
    }

    /// Per process status: nothing on a finished process; escalate, pause (or resume) and cancel
    /// on a live one; a compensating process cannot be cancelled (its undo would stop half-way).
    #[test]
    fn the_allowed_actions_follow_the_process_status() {
        let none: [StepView; 0] = [];
        for s in ProcessStatus::ALL.into_iter().filter(|s| s.is_terminal()) {
            assert!(allowed_actions(&process(s, false), &none).is_empty(), "{s}");
        }
        for s in [
            ProcessStatus::Pending,
            ProcessStatus::Running,
            ProcessStatus::Waiting,
        ] {
            assert_eq!(
                allowed_actions(&process(s, false), &none),
                vec![Action::Escalate, Action::Pause, Action::Cancel],
                "{s}"
            );
        }
        assert_eq!(
            allowed_actions(&process(ProcessStatus::Running, true), &none),
            vec![Action::Escalate, Action::Resume, Action::Cancel]
        );
        assert_eq!(
            allowed_actions(&process(ProcessStatus::Compensating, false), &none),
            vec![Action::Escalate, Action::Pause]
        );
    }

    /// In manual review, per step: a forward step may run again (and a queryable remote be asked),
    /// a compensation may run, either may be resolved; the process is not escalated again.
    #[test]
    fn in_manual_review_the_step_actions_come_first() {
        let p = process(ProcessStatus::ManualReview, false);
        let local = [view(1, Role::Forward, "local", ManualReview)];
        assert_eq!(
            allowed_actions(&p, &local),
            vec![
                Action::RerunStep { seq: 1 },
                Action::ResolveSucceeded { seq: 1 },
                Action::ResolveFailed { seq: 1 },
                Action::Pause,
                Action::Cancel,
            ]
        );
        let refund = [
            view(1, Role::Forward, "external", Succeeded),
            view(2, Role::Compensation, "external", ManualReview),
        ];
        let allowed = allowed_actions(&p, &refund);
        assert_eq!(allowed.first(), Some(&Action::RunCompensation { seq: 2 }));
        assert!(!allowed.contains(&Action::RerunStep { seq: 1 }));
        assert!(!allowed.contains(&Action::Escalate));
        // A remote that offers neither key nor query is never called again on an unknown outcome.
        let unknown = [StepView {
            remote: Some(Remote::Neither.as_str().into()),
            error_class: Some("unknown".into()),
            ..view(1, Role::Forward, "external", ManualReview)
        }];
        assert!(!allowed_actions(&p, &unknown).contains(&Action::RerunStep { seq: 1 }));
    }

    /// Resolving as failed a step whose outcome is unknown needs the remote's answer and a second
    /// person; after a known failure it needs neither. Resolving as succeeded always needs
    /// evidence, running a compensation a second person.
    #[test]
    fn resolving_an_unknown_outcome_as_failed_needs_a_remote_check_and_a_second_person() {
        let unknown = [StepView {
            remote: Some(Remote::HonoursKey.as_str().into()),
            error_class: Some("unknown".into()),
            ..view(1, Role::Forward, "external", ManualReview)
        }];
        let failed = Action::ResolveFailed { seq: 1 };
        let needs = requirements(&failed, &unknown);
        assert!(needs.remote_check && needs.second_person && !needs.evidence);
        let known = [StepView {
            error_class: Some("permanent".into()),
            ..unknown[0].clone()
        }];
        assert_eq!(requirements(&failed, &known), Requirements::default());
        let local = [StepView {
            execution: "local".into(),
            ..unknown[0].clone()
        }];
        assert_eq!(requirements(&failed, &local), Requirements::default());
        let succeeded = requirements(&Action::ResolveSucceeded { seq: 1 }, &known);
        assert!(succeeded.evidence && succeeded.second_person);
        let run = requirements(&Action::RunCompensation { seq: 1 }, &known);
        assert!(run.second_person && !run.evidence && !run.remote_check);
        assert_eq!(doubts(&unknown).len(), 1);
        assert!(doubts(&known).is_empty());
    }
}
