//! The circuit's decisions, pure and unit-tested beside them: may a call go now ([`admit`]), and
//! what an answer changes ([`record`]). The store reads a [`Circuit`] row, asks these, and writes
//! the new row back compared-and-set on its version.
//!
//! | state | event | result |
//! |---|---|---|
//! | closed | admit | go |
//! | closed | answered | closed (the count of unavailable answers in a row reset) |
//! | closed | unavailable, below the rules | closed, counted |
//! | closed | unavailable, at the threshold or over the failure rate | open (down since now, first cool-down) |
//! | closed | no answer (timeout after sending) | unchanged: an unknown outcome is not unavailability |
//! | open | admit before the probe time | wait until it |
//! | open | admit at or after it | go as the probe; half open until the probe's lease ends |
//! | half open | admit, probe lease running | wait until the lease ends |
//! | half open | admit, probe lease over (its caller died) | go as the new probe |
//! | half open (the probe) | answered | closed |
//! | half open (the probe) | unavailable | open, cool-down doubled (at most the maximum) |
//! | half open (the probe) | no answer | open, same cool-down |
//! | forced open (an operator) | admit | wait until an operator closes it |
//!
//! A remote's `Retry-After` puts the probe time later, never earlier.

use crate::policy::Policy;
use crate::state::CircuitState;
use chrono::{DateTime, TimeDelta, Utc};
use std::time::Duration;

/// A dependency's shared circuit, as stored in `dependencies`.
#[derive(Debug, Clone, PartialEq)]
pub struct Circuit {
    pub state: CircuitState,
    pub forced_open: bool,
    /// Unavailable answers in a row while closed.
    pub consecutive: i32,
    pub window_started_at: Option<DateTime<Utc>>,
    pub window_calls: i32,
    pub window_unavailable: i32,
    /// When the current outage began (None while closed).
    pub down_since: Option<DateTime<Utc>>,
    pub cooldown: Duration,
    /// While open: the earliest probe.
    pub probe_at: Option<DateTime<Utc>>,
    /// While half open: the probe's lease.
    pub probe_until: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    /// Why the last change happened.
    pub reason: String,
    /// Compare-and-set version of the row.
    pub version: i64,
}

impl Circuit {
    /// A new dependency's circuit: closed, nothing counted.
    pub fn new() -> Self {
        Self {
            state: CircuitState::Closed,
            forced_open: false,
            consecutive: 0,
            window_started_at: None,
            window_calls: 0,
            window_unavailable: 0,
            down_since: None,
            cooldown: Duration::ZERO,
            probe_at: None,
            probe_until: None,
            last_error: None,
            reason: "declared".into(),
            version: 0,
        }
    }

    /// Closed and not forced open: a call goes without asking the database again.
    pub fn lets_through(&self) -> bool {
        self.state == CircuitState::Closed && !self.forced_open
    }
}

impl Default for Circuit {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a call waits instead of going.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitReason {
    /// The circuit is open (since `since`).
    Open { since: Option<DateTime<Utc>> },
    /// Another caller's probe is in flight.
    Probing { since: Option<DateTime<Utc>> },
    /// An operator opened the circuit.
    ForcedOpen,
    /// The rate limit's bucket is empty.
    RateLimited,
    /// Every concurrency slot is taken.
    Saturated,
}

impl WaitReason {
    /// The label of the refusal metric.
    pub fn as_str(&self) -> &'static str {
        match self {
            WaitReason::Open { .. } => "open",
            WaitReason::Probing { .. } => "probing",
            WaitReason::ForcedOpen => "forced_open",
            WaitReason::RateLimited => "rate_limited",
            WaitReason::Saturated => "saturated",
        }
    }

    /// In words, for a step's reason and the console: "circuit open since 12:03:07 UTC".
    pub fn describe(&self) -> String {
        let since = |s: &Option<DateTime<Utc>>| {
            s.map(|t| format!(" since {}", t.format("%Y-%m-%d %H:%M:%S UTC")))
                .unwrap_or_default()
        };
        match self {
            WaitReason::Open { since: s } => format!("circuit open{}", since(s)),
            WaitReason::Probing { since: s } => {
                format!("circuit half open{}, a probe is in flight", since(s))
            }
            WaitReason::ForcedOpen => "circuit opened by an operator".into(),
            WaitReason::RateLimited => "rate limit reached".into(),
            WaitReason::Saturated => "concurrency cap reached".into(),
        }
    }
}

/// What the circuit says to a caller now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Call. `probe`: this call decides whether the circuit closes.
    Go { probe: bool },
    /// Do not call before `until`.
    Wait {
        until: DateTime<Utc>,
        reason: WaitReason,
    },
}

/// How long a forced-open circuit's callers wait before they look again.
pub const FORCED_RECHECK: Duration = Duration::from_secs(30);

/// `d` after `at`, saturating.
pub fn after(at: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// May a call go at `now`? Returns the answer and, when the circuit changes (a probe taken), the
/// new circuit to store. `probe_lease`: how long a probe may take before another caller may probe
/// (the call's timeout and a margin).
pub fn admit(c: &Circuit, now: DateTime<Utc>, probe_lease: Duration) -> (Admit, Option<Circuit>) {
    if c.forced_open {
        let until = after(now, FORCED_RECHECK);
        let reason = WaitReason::ForcedOpen;
        return (Admit::Wait { until, reason }, None);
    }
    let take_probe = |why: &str| {
        let next = Circuit {
            state: CircuitState::HalfOpen,
            probe_until: Some(after(now, probe_lease)),
            reason: why.to_string(),
            ..c.clone()
        };
        (Admit::Go { probe: true }, Some(next))
    };
    match c.state {
        CircuitState::Closed => (Admit::Go { probe: false }, None),
        CircuitState::Open => match c.probe_at {
            Some(at) if at > now => {
                let reason = WaitReason::Open {
                    since: c.down_since,
                };
                (Admit::Wait { until: at, reason }, None)
            }
            _ => take_probe("cool-down over: one probe call"),
        },
        CircuitState::HalfOpen => match c.probe_until {
            Some(until) if until > now => {
                let reason = WaitReason::Probing {
                    since: c.down_since,
                };
                (Admit::Wait { until, reason }, None)
            }
            _ => take_probe("the previous probe's lease ran out: another probe call"),
        },
    }
}

/// What a call's answer says about the remote's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The remote answered (success, or a definitive refusal such as 400 or 402): it is up.
    Answered,
    /// Refused before anything was done (503, 429, connection refused, a timeout before the
    /// request was sent), with the remote's `Retry-After` if it gave one.
    Unavailable {
        retry_after: Option<Duration>,
        message: String,
    },
    /// No answer after the request was sent: the outcome is unknown. It says nothing about
    /// availability and is never counted as unavailable; only a probe that ends so re-opens.
    NoAnswer,
}

/// The circuit after `outcome` of a call (`probe`: the call was the probe) at `now`; `None` when
/// nothing changes (the happy path writes nothing).
pub fn record(
    c: &Circuit,
    outcome: &Outcome,
    probe: bool,
    policy: &Policy,
    now: DateTime<Utc>,
) -> Option<Circuit> {
    let probing = probe && c.state == CircuitState::HalfOpen;
    match outcome {
        Outcome::Answered if probe && c.state != CircuitState::Closed => {
            Some(closed(c, "the probe call was answered: the remote is back"))
        }
        // A call let through before the circuit opened is no probe: only the probe closes it.
        Outcome::Answered if c.state != CircuitState::Closed => None,
        Outcome::Answered => answered_while_closed(c, policy, now),
        Outcome::NoAnswer if probing => Some(reopen(
            c,
            c.cooldown.max(policy.cooldown),
            None,
            now,
            "the probe call got no answer",
        )),
        Outcome::NoAnswer => None,
        Outcome::Unavailable {
            retry_after,
            message,
        } => {
            if probing {
                let cooldown = policy.next_cooldown(c.cooldown);
                let mut next = reopen(c, cooldown, *retry_after, now, "the probe call was refused");
                next.last_error = Some(message.clone());
                return Some(next);
            }
            match c.state {
                CircuitState::Closed => {
                    unavailable_while_closed(c, policy, *retry_after, message, now)
                }
                // A call let through before the circuit opened answered late: only a later
                // Retry-After moves the probe.
                CircuitState::Open | CircuitState::HalfOpen => {
                    let later = retry_after.map(|d| after(now, d));
                    match (c.state, later, c.probe_at) {
                        (CircuitState::Open, Some(l), Some(at)) if l > at => Some(Circuit {
                            probe_at: Some(l),
                            reason: "the remote asked for a later retry".into(),
                            ..c.clone()
                        }),
                        _ => None,
                    }
                }
            }
        }
    }
}

/// The circuit closed again, everything counted reset (what an operator's hand and the last
/// error are, stays).
fn closed(c: &Circuit, why: &str) -> Circuit {
    Circuit {
        forced_open: c.forced_open,
        last_error: c.last_error.clone(),
        reason: why.into(),
        version: c.version,
        ..Circuit::new()
    }
}

/// The circuit (re)opened with `cooldown`, probed again after it or after `retry_after`.
fn reopen(
    c: &Circuit,
    cooldown: Duration,
    retry_after: Option<Duration>,
    now: DateTime<Utc>,
    why: &str,
) -> Circuit {
    let wait = retry_after.map_or(cooldown, |r| r.max(cooldown));
    Circuit {
        state: CircuitState::Open,
        down_since: c.down_since.or(Some(now)),
        cooldown,
        probe_at: Some(after(now, wait)),
        probe_until: None,
        consecutive: 0,
        window_started_at: None,
        window_calls: 0,
        window_unavailable: 0,
        reason: format!("{why}; next probe in {:.1}s", wait.as_secs_f64()),
        ..c.clone()
    }
}

/// The failure-rate window at `now`: the same one, or a new one when it is over.
fn window(c: &Circuit, policy: &Policy, now: DateTime<Utc>) -> (DateTime<Utc>, i32, i32) {
    match (policy.failure_rate, c.window_started_at) {
        (Some(r), Some(start)) if after(start, r.window) > now => {
            (start, c.window_calls, c.window_unavailable)
        }
        _ => (now, 0, 0),
    }
}

fn answered_while_closed(c: &Circuit, policy: &Policy, now: DateTime<Utc>) -> Option<Circuit> {
    if policy.failure_rate.is_none() {
        return (c.consecutive > 0).then(|| Circuit {
            consecutive: 0,
            reason: "answered again".into(),
            ..c.clone()
        });
    }
    let (start, calls, unavailable) = window(c, policy, now);
    Some(Circuit {
        consecutive: 0,
        window_started_at: Some(start),
        window_calls: calls.saturating_add(1),
        window_unavailable: unavailable,
        ..c.clone()
    })
}

fn unavailable_while_closed(
    c: &Circuit,
    policy: &Policy,
    retry_after: Option<Duration>,
    message: &str,
    now: DateTime<Utc>,
) -> Option<Circuit> {
    let consecutive = c.consecutive.saturating_add(1);
    let (start, calls, unavailable) = window(c, policy, now);
    let (calls, unavailable) = (calls.saturating_add(1), unavailable.saturating_add(1));
    let by_rate = policy.failure_rate.is_some_and(|r| {
        calls as u32 >= r.min_calls && f64::from(unavailable) / f64::from(calls) >= r.ratio
    });
    let by_count = consecutive as u32 >= policy.consecutive;
    let mut next = if by_count || by_rate {
        let why = if by_count {
            format!("{consecutive} unavailable answers in a row: circuit opened")
        } else {
            format!("{unavailable} of {calls} answers unavailable: circuit opened")
        };
        reopen(c, policy.cooldown, retry_after, now, &why)
    } else {
        Circuit {
            consecutive,
            window_started_at: policy.failure_rate.map(|_| start),
            window_calls: if policy.failure_rate.is_some() {
                calls
            } else {
                0
            },
            window_unavailable: if policy.failure_rate.is_some() {
                unavailable
            } else {
                0
            },
            reason: format!("{consecutive} unavailable answers in a row"),
            ..c.clone()
        }
    };
    next.last_error = Some(message.to_string());
    Some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }
    fn down(retry_after: Option<u64>) -> Outcome {
        Outcome::Unavailable {
            retry_after: retry_after.map(Duration::from_secs),
            message: "503".into(),
        }
    }
    const LEASE: Duration = Duration::from_secs(10);

    fn opened(policy: &Policy) -> Circuit {
        let mut c = Circuit::new();
        for _ in 0..policy.consecutive {
            c = record(&c, &down(None), false, policy, t(0)).unwrap();
        }
        c
    }

    #[test]
    fn a_closed_circuit_lets_calls_go_and_the_happy_path_writes_nothing() {
        let p = Policy::default();
        let c = Circuit::new();
        assert_eq!(admit(&c, t(0), LEASE), (Admit::Go { probe: false }, None));
        assert_eq!(record(&c, &Outcome::Answered, false, &p, t(0)), None);
    }

    #[test]
    fn it_opens_at_the_threshold_of_unavailable_answers_in_a_row_and_an_answer_resets_the_count() {
        let p = Policy::default().consecutive(3);
        let c = record(&Circuit::new(), &down(None), false, &p, t(0)).unwrap();
        let c = record(&c, &down(None), false, &p, t(0)).unwrap();
        assert_eq!((c.state, c.consecutive), (CircuitState::Closed, 2));
        let reset = record(&c, &Outcome::Answered, false, &p, t(0)).unwrap();
        assert_eq!(reset.consecutive, 0);
        let open = record(&c, &down(None), false, &p, t(1)).unwrap();
        assert_eq!(open.state, CircuitState::Open);
        assert_eq!(open.down_since, Some(t(1)));
        assert_eq!(open.probe_at, Some(t(1) + TimeDelta::seconds(2)));
        assert_eq!(open.last_error.as_deref(), Some("503"));
    }

    #[test]
    fn an_unknown_outcome_never_counts_as_unavailable() {
        let p = Policy::default().consecutive(1);
        assert_eq!(
            record(&Circuit::new(), &Outcome::NoAnswer, false, &p, t(0)),
            None
        );
    }

    #[test]
    fn an_open_circuit_waits_then_lets_exactly_one_probe_through() {
        let p = Policy::default().consecutive(1);
        let c = opened(&p);
        let (a, none) = admit(&c, t(1), LEASE);
        assert!(
            matches!(a, Admit::Wait { until, reason: WaitReason::Open { .. } } if until == t(2))
        );
        assert_eq!(none, None);
        let (a, probing) = admit(&c, t(2), LEASE);
        assert_eq!(a, Admit::Go { probe: true });
        let probing = probing.unwrap();
        assert_eq!(probing.state, CircuitState::HalfOpen);
        let (a, _) = admit(&probing, t(3), LEASE);
        assert!(
            matches!(a, Admit::Wait { until, reason: WaitReason::Probing { .. } } if until == t(12))
        );
        // The probe's caller died: after its lease another caller probes.
        let (a, again) = admit(&probing, t(12), LEASE);
        assert_eq!(a, Admit::Go { probe: true });
        assert_eq!(again.unwrap().probe_until, Some(t(22)));
    }

    #[test]
    fn a_failed_probe_doubles_the_cooldown_up_to_the_maximum_and_keeps_the_outage_start() {
        let p = Policy::default()
            .consecutive(1)
            .cooldown(Duration::from_secs(2), Duration::from_secs(5));
        let mut c = opened(&p);
        let mut cooldowns = vec![];
        for i in 0..4 {
            let at = c.probe_at.unwrap();
            let (_, probing) = admit(&c, at, LEASE);
            c = record(&probing.unwrap(), &down(None), true, &p, at).unwrap();
            assert_eq!(c.state, CircuitState::Open, "probe {i}");
            cooldowns.push(c.cooldown.as_secs());
        }
        assert_eq!(cooldowns, vec![4, 5, 5, 5]);
        assert_eq!(c.down_since, Some(t(0)));
    }

    #[test]
    fn an_answered_probe_closes_and_resets() {
        let p = Policy::default().consecutive(1);
        let c = opened(&p);
        let (_, probing) = admit(&c, t(2), LEASE);
        let closed = record(&probing.unwrap(), &Outcome::Answered, true, &p, t(3)).unwrap();
        assert_eq!(closed.state, CircuitState::Closed);
        assert_eq!((closed.down_since, closed.cooldown), (None, Duration::ZERO));
        assert!(closed.lets_through());
    }

    #[test]
    fn a_probe_without_answer_reopens_with_the_same_cooldown() {
        let p = Policy::default().consecutive(1);
        let c = opened(&p);
        let (_, probing) = admit(&c, t(2), LEASE);
        let c = record(&probing.unwrap(), &Outcome::NoAnswer, true, &p, t(3)).unwrap();
        assert_eq!(
            (c.state, c.cooldown),
            (CircuitState::Open, Duration::from_secs(2))
        );
    }

    #[test]
    fn retry_after_moves_the_probe_later_never_earlier() {
        let p = Policy::default().consecutive(1);
        let c = record(&Circuit::new(), &down(Some(30)), false, &p, t(0)).unwrap();
        assert_eq!(c.probe_at, Some(t(30)));
        let c2 = record(&Circuit::new(), &down(Some(1)), false, &p, t(0)).unwrap();
        assert_eq!(c2.probe_at, Some(t(2)), "the cool-down is the floor");
        // A late answer of a call let through before the circuit opened.
        let later = record(&c2, &down(Some(60)), false, &p, t(1)).unwrap();
        assert_eq!(later.probe_at, Some(t(61)));
        assert_eq!(record(&later, &down(Some(1)), false, &p, t(1)), None);
    }

    #[test]
    fn the_failure_rate_rule_opens_over_its_share_within_a_window() {
        let p = Policy::default()
            .consecutive(100)
            .failure_rate(0.5, Duration::from_secs(10), 4);
        let mut c = Circuit::new();
        for (i, o) in [Outcome::Answered, down(None), Outcome::Answered]
            .iter()
            .enumerate()
        {
            c = record(&c, o, false, &p, t(i as i64)).unwrap();
            assert_eq!(c.state, CircuitState::Closed);
        }
        let open = record(&c, &down(None), false, &p, t(3)).unwrap();
        assert_eq!(open.state, CircuitState::Open, "2 of 4 unavailable");
        // The same answers spread over two windows do not open it.
        let late = record(&c, &down(None), false, &p, t(11)).unwrap();
        assert_eq!((late.state, late.window_calls), (CircuitState::Closed, 1));
    }

    #[test]
    fn a_forced_open_circuit_waits_whatever_its_state() {
        let c = Circuit {
            forced_open: true,
            ..Circuit::new()
        };
        let (a, _) = admit(&c, t(0), LEASE);
        assert!(matches!(
            a,
            Admit::Wait {
                reason: WaitReason::ForcedOpen,
                ..
            }
        ));
        assert!(!c.lets_through());
    }
}
