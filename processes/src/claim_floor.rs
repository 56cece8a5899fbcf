//! Where a worker's claim starts reading `processes_due_idx` (issue 39).
//!
//! The claim takes the oldest due processes (`ORDER BY next_run_at`). Every claim and every
//! finished process leaves a dead entry in that index; while an old snapshot holds back vacuum
//! no scan may mark them, so a claim that reads from the front of the index walks every process
//! claimed since the snapshot began, again in each claim. With a floor, a claim reads from the
//! oldest due time its previous claim took: the entries in front of it belong to processes that
//! were already claimed, locked by another worker or of kinds this worker does not run.
//!
//! A process can still become due in front of the floor: one started by a transaction that
//! commits after a claim passed its due time, one an operator resumes, one another worker let go.
//! So every [`FRONT_EVERY`] a claim reads from the front again; such a process waits at most that
//! long. Without an old snapshot the front is cheap (scans mark the dead entries as they pass)
//! and the floor changes nothing else.

use chrono::{DateTime, Utc};
use std::time::{Duration, Instant};

/// How often a claim reads from the front of the index whatever the floor: the longest a process
/// that became due in front of the floor waits.
pub const FRONT_EVERY: Duration = Duration::from_secs(5);

/// A worker's claim floor: the oldest due time its last claim took, and when it last read from
/// the front.
#[derive(Debug, Default)]
pub struct ClaimFloor {
    floor: Option<DateTime<Utc>>,
    front_read_at: Option<Instant>,
}

impl ClaimFloor {
    /// Where the next claim starts: `None` for the front (no floor yet, or [`FRONT_EVERY`] since
    /// the last claim from the front), else the floor.
    pub fn start(&self, now: Instant) -> Option<DateTime<Utc>> {
        match self.front_read_at {
            Some(at) if now.duration_since(at) < FRONT_EVERY => self.floor,
            _ => None,
        }
    }

    /// Records a claim that started at `from` ([`Self::start`]) and took processes whose oldest
    /// due time was `oldest` (`None` if it took none). A claim that took nothing keeps the floor:
    /// nothing due past it now, and what is in front of it is read at the next front read.
    pub fn claimed(
        &mut self,
        now: Instant,
        from: Option<DateTime<Utc>>,
        oldest: Option<DateTime<Utc>>,
    ) {
        if from.is_none() {
            self.front_read_at = Some(now);
        }
        if let Some(oldest) = oldest {
            self.floor = Some(oldest);
        }
    }

    /// Forgets the floor (after a failed claim): the next claim reads from the front.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + s, 0).unwrap()
    }

    #[test]
    fn the_first_claim_reads_from_the_front_and_sets_the_floor() {
        let now = Instant::now();
        let mut f = ClaimFloor::default();
        assert_eq!(f.start(now), None);
        f.claimed(now, None, Some(t(10)));
        assert_eq!(f.start(now + Duration::from_millis(100)), Some(t(10)));
    }

    #[test]
    fn the_floor_moves_to_each_claims_oldest_due_time_and_stays_when_a_claim_takes_nothing() {
        let now = Instant::now();
        let mut f = ClaimFloor::default();
        f.claimed(now, None, Some(t(10)));
        let later = now + Duration::from_secs(1);
        f.claimed(later, f.start(later), Some(t(12)));
        assert_eq!(f.start(later), Some(t(12)));
        f.claimed(later, f.start(later), None);
        assert_eq!(
            f.start(later),
            Some(t(12)),
            "an empty claim keeps the floor"
        );
    }

    #[test]
    fn a_claim_reads_from_the_front_again_every_front_every() {
        let now = Instant::now();
        let mut f = ClaimFloor::default();
        f.claimed(now, None, Some(t(10)));
        let just_before = now + FRONT_EVERY - Duration::from_millis(1);
        assert_eq!(f.start(just_before), Some(t(10)));
        f.claimed(just_before, Some(t(10)), Some(t(11)));
        let due = now + FRONT_EVERY;
        assert_eq!(
            f.start(due),
            None,
            "floored claims do not postpone the front read"
        );
        f.claimed(due, None, Some(t(3)));
        assert_eq!(
            f.start(due + Duration::from_millis(1)),
            Some(t(3)),
            "a front read may move the floor back"
        );
    }

    #[test]
    fn a_failed_claim_forgets_the_floor() {
        let now = Instant::now();
        let mut f = ClaimFloor::default();
        f.claimed(now, None, Some(t(10)));
        f.reset();
        assert_eq!(f.start(now), None);
    }
}
