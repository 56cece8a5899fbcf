//! What happens to an aggregate's messages in one transaction, decided from its position alone:
//! which to apply now (in order), which to hold, which are stale. Pure, so every case is a unit
//! test below.

use std::collections::BTreeSet;

/// An aggregate's position as the transaction found it (its row locked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Last applied `aggregate_seq` (0: none yet).
    pub applied: i64,
    /// The head failed and waits: for its retry time (`true` while that time is in the future)
    /// or for an operator (parked). Nothing is applied while it waits.
    pub head_waits: bool,
}

/// The plan for one aggregate.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Sequence numbers to apply now, ascending and consecutive from `applied + 1`: each comes
    /// from a delivery of this batch or from the held messages.
    pub apply: Vec<i64>,
    /// Arrived sequence numbers to hold (ahead of a gap, or behind a waiting head), not held yet.
    pub hold: Vec<i64>,
    /// Arrived sequence numbers already held: a copy of what waits, settled without a write.
    pub already_held: Vec<i64>,
    /// Arrived at or below the position: a copy of an applied message, or one older than it (a
    /// bug upstream). Never applied; reported.
    pub stale: Vec<i64>,
}

/// Decides an aggregate's plan. `arrived`: the sequence numbers delivered in this batch (copies
/// collapsed); `held`: those waiting in `consumer_held`.
pub fn plan(position: Position, arrived: &BTreeSet<i64>, held: &BTreeSet<i64>) -> Plan {
    let mut plan = Plan::default();
    let mut next = position.applied + 1;
    if !position.head_waits {
        while arrived.contains(&next) || held.contains(&next) {
            plan.apply.push(next);
            next += 1;
        }
    }
    for &seq in arrived {
        if seq <= position.applied {
            plan.stale.push(seq);
        } else if seq < next {
            // Applied now.
        } else if held.contains(&seq) {
            plan.already_held.push(seq);
        } else {
            plan.hold.push(seq);
        }
    }
    plan
}

/// After the message `failed` (an element of `plan.apply`) failed, or cannot be applied now: the
/// ones before it stay applied, it and everything after it are held instead. Returns what must be
/// newly held (those that came with this batch; held ones stay where they are), `plan.hold`
/// included.
pub fn cut_at_failure(plan: &mut Plan, failed: i64, held: &BTreeSet<i64>) -> Vec<i64> {
    let at = plan
        .apply
        .iter()
        .position(|s| *s == failed)
        .unwrap_or(plan.apply.len());
    let rest = plan.apply.split_off(at);
    let mut newly: Vec<i64> = rest.into_iter().filter(|s| !held.contains(s)).collect();
    newly.append(&mut plan.hold);
    newly.sort_unstable();
    newly
}

/// What a failed head becomes: retried after `delay` (attempt `attempts` of `max_attempts`) or
/// parked for an operator (attempts ran out, or the failure is permanent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadFailure {
    RetryAfterAttempt(u32),
    Park,
    /// A remote its handler needs is unavailable: the aggregate waits this long and tries the
    /// head again, no attempt spent, never parked for it.
    Wait(std::time::Duration),
}

pub fn head_failure(attempts_before: u32, max_attempts: u32, permanent: bool) -> HeadFailure {
    let attempts = attempts_before.saturating_add(1);
    if permanent || attempts >= max_attempts {
        HeadFailure::Park
    } else {
        HeadFailure::RetryAfterAttempt(attempts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(s: &[i64]) -> BTreeSet<i64> {
        s.iter().copied().collect()
    }

    fn pos(applied: i64) -> Position {
        Position {
            applied,
            head_waits: false,
        }
    }

    #[test]
    fn in_order_messages_apply_at_once() {
        let p = plan(pos(2), &set(&[3, 4, 5]), &set(&[]));
        assert_eq!(p.apply, vec![3, 4, 5]);
        assert!(p.hold.is_empty() && p.stale.is_empty());
    }

    #[test]
    fn a_message_ahead_of_a_gap_is_held() {
        let p = plan(pos(2), &set(&[4, 5]), &set(&[]));
        assert!(p.apply.is_empty());
        assert_eq!(p.hold, vec![4, 5]);
    }

    #[test]
    fn the_missing_message_releases_what_was_held_in_order() {
        let p = plan(pos(2), &set(&[3]), &set(&[4, 5, 7]));
        assert_eq!(p.apply, vec![3, 4, 5]);
        assert!(p.hold.is_empty(), "7 stays held where it is");
    }

    #[test]
    fn copies_and_older_messages_are_stale_never_applied() {
        let p = plan(pos(5), &set(&[2, 5, 6]), &set(&[]));
        assert_eq!(p.stale, vec![2, 5]);
        assert_eq!(p.apply, vec![6]);
    }

    #[test]
    fn a_copy_of_a_held_message_is_not_held_twice() {
        let p = plan(pos(1), &set(&[4]), &set(&[4]));
        assert_eq!(p.already_held, vec![4]);
        assert!(p.hold.is_empty() && p.apply.is_empty());
    }

    #[test]
    fn behind_a_waiting_head_everything_new_is_held() {
        let waiting = Position {
            applied: 3,
            head_waits: true,
        };
        let p = plan(waiting, &set(&[3, 4, 5]), &set(&[4]));
        assert!(p.apply.is_empty());
        assert_eq!(p.stale, vec![3]);
        assert_eq!(p.already_held, vec![4]);
        assert_eq!(p.hold, vec![5]);
    }

    #[test]
    fn a_failure_holds_the_failing_message_and_its_successors() {
        let held = set(&[5]);
        let mut p = plan(pos(2), &set(&[3, 4, 6, 8]), &held);
        assert_eq!(p.apply, vec![3, 4, 5, 6]);
        assert_eq!(p.hold, vec![8]);
        let newly = cut_at_failure(&mut p, 4, &held);
        assert_eq!(p.apply, vec![3]);
        assert_eq!(newly, vec![4, 6, 8], "5 is held already");
    }

    #[test]
    fn attempts_run_out_or_a_permanent_failure_parks() {
        assert_eq!(head_failure(0, 5, false), HeadFailure::RetryAfterAttempt(1));
        assert_eq!(head_failure(3, 5, false), HeadFailure::RetryAfterAttempt(4));
        assert_eq!(head_failure(4, 5, false), HeadFailure::Park);
        assert_eq!(head_failure(0, 5, true), HeadFailure::Park);
        assert_eq!(head_failure(0, 1, false), HeadFailure::Park);
    }
}
