//! What this relay holds from the outbox, and how much of each partition the next claim asks for.
//!
//! Every claimed row stays held until it is settled (marked published, or given back after a
//! failure); claims exclude held rows, so one relay never sends a row twice. A claim may run while
//! a mark commits: rows whose mark finished during a claim are remembered until that claim
//! returns, so a snapshot taken before the delete cannot resurrect them. Rows given back bump the
//! generation: a claim that started before cannot know those rows are free again (its rows, later
//! ones of the same aggregates, would overtake them), so its result is dropped and the claim redone.

use super::positions::{LateArgs, Positions, Snapshot};
use std::collections::{HashMap, HashSet};

#[derive(Debug, Default)]
pub(super) struct Claims {
    /// Every claimed, unsettled row: seq -> partition.
    held: HashMap<i64, i16>,
    generation: u64,
    /// Rows whose mark finished while a claim was running.
    marked_during_claim: HashSet<i64>,
    claim_running: bool,
    /// Claim again without waiting for a wake-up (the last claim found rows).
    pub more: bool,
    /// Rows asked of each partition by the next claim, where it differs from the base.
    sizes: HashMap<i16, i64>,
    /// Where each partition's claim starts, and the transactions that may commit below it.
    positions: Positions,
}

/// The arguments of one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ClaimPlan {
    pub partitions: Vec<i16>,
    /// Rows asked of each partition (same order as `partitions`).
    pub limits: Vec<i64>,
    /// Rows in all.
    pub limit: i64,
    pub held: Vec<i64>,
    pub generation: u64,
    /// Where each partition's forward read starts (same order as `partitions`).
    pub floors: Vec<i64>,
    /// The transactions whose rows may have committed below the floors.
    pub late: LateArgs,
}

/// A claimed row's fate.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// New: hold it.
    Take,
    /// Already held, or marked while the claim ran: ignore it.
    Known,
}

impl Claims {
    pub fn new() -> Self {
        Self {
            more: true,
            ..Self::default()
        }
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    #[cfg(test)]
    pub fn is_held(&self, seq: i64) -> bool {
        self.held.contains_key(&seq)
    }

    pub fn hold(&mut self, seq: i64, partition: i16) {
        self.held.insert(seq, partition);
    }

    /// The row is given back (or settled elsewhere): a later claim may hand it out again, so its
    /// partition's claim starts below it again. (Marked and buried rows are settled through
    /// [`Self::marked`] and [`Self::buried`].)
    pub fn release(&mut self, seq: i64) {
        if let Some(p) = self.held.remove(&seq) {
            self.positions.returned(p, seq);
        }
    }

    /// Rows went back to the outbox: running claims are stale.
    pub fn gave_back(&mut self, seqs: impl IntoIterator<Item = i64>) {
        self.generation += 1;
        for s in seqs {
            self.release(s);
        }
    }

    /// Keeps only the rows `keep` says (confirmed rows waiting for their mark) and starts a new
    /// generation: everything else went back to the outbox.
    pub fn retain(&mut self, keep: impl Fn(i64) -> bool) {
        self.generation += 1;
        let back: Vec<i64> = self.held.keys().copied().filter(|s| !keep(*s)).collect();
        for s in back {
            self.release(s);
        }
    }

    /// A row the claim returned that this relay did not take (its partition closed meanwhile):
    /// it is still in the outbox, below where the partition's claim now starts.
    pub fn not_taken(&mut self, partition: i16, seq: i64) {
        self.positions.returned(partition, seq);
    }

    /// The claim of `plan` returned `rows` (partition, seq) after taking `snapshot`: each
    /// partition's claim starts past what it read (see `positions`).
    pub fn positioned(&mut self, plan: &ClaimPlan, rows: &[(i16, i64)], snapshot: &Snapshot) {
        let held = &self.held;
        self.positions.claimed(
            (&plan.partitions, &plan.limits, plan.limit),
            &plan.floors,
            rows,
            snapshot,
            |s| held.contains_key(&s),
        );
    }

    /// This relay took `partition` over (again): its claim starts from the beginning.
    pub fn taken_over(&mut self, partition: i16) {
        self.positions.forget(partition);
    }

    /// Rows were marked: no longer held, and remembered against the running claim's snapshot.
    pub fn marked(&mut self, seqs: &[i64]) {
        for seq in seqs {
            self.held.remove(seq);
            if self.claim_running {
                self.marked_during_claim.insert(*seq);
            }
        }
    }

    /// Partitions with held rows (a partition is released only when none are left).
    pub fn busy_partitions(&self) -> HashSet<i16> {
        self.held.values().copied().collect()
    }

    /// Plans a claim of `partitions`: the base share of `2 * batch` each, more for partitions
    /// whose last claim came back full (one hot aggregate must not wait for many small claims).
    pub fn plan(&mut self, partitions: Vec<i16>, batch: i64) -> ClaimPlan {
        let base = Self::base(partitions.len(), batch);
        let limits = partitions
            .iter()
            .map(|p| self.sizes.get(p).copied().unwrap_or(base))
            .collect();
        self.claim_running = true;
        self.more = false;
        ClaimPlan {
            floors: self.positions.floors(&partitions),
            late: self.positions.late(),
            partitions,
            limits,
            limit: batch,
            held: self.held.keys().copied().collect(),
            generation: self.generation,
        }
    }

    fn base(partitions: usize, batch: i64) -> i64 {
        ((batch * 2) / partitions.max(1) as i64).clamp(8.min(batch), batch)
    }

    /// A claim returned (`counts`: rows per partition, `None` if it failed). Returns whether its
    /// rows may be used: not if rows were given back while it ran.
    pub fn returned(
        &mut self,
        plan: &ClaimPlan,
        counts: Option<&HashMap<i16, i64>>,
        batch: i64,
    ) -> bool {
        self.claim_running = false;
        let Some(counts) = counts else {
            self.marked_during_claim.clear();
            self.more = true;
            return false;
        };
        let base = Self::base(plan.partitions.len(), batch);
        for (p, asked) in plan.partitions.iter().zip(&plan.limits) {
            let got = counts.get(p).copied().unwrap_or(0);
            if got >= *asked && got > 0 {
                self.sizes.insert(*p, (asked * 2).min(batch));
            } else if got < base {
                self.sizes.remove(p);
            }
        }
        if plan.generation != self.generation {
            self.marked_during_claim.clear();
            self.more = true;
            return false;
        }
        if counts.values().any(|n| *n > 0) {
            self.more = true;
        }
        true
    }

    /// Whether a row of the claim just returned is new.
    pub fn admit(&self, seq: i64) -> Admit {
        if self.held.contains_key(&seq) || self.marked_during_claim.contains(&seq) {
            Admit::Known
        } else {
            Admit::Take
        }
    }

    /// The claim's rows have been admitted: forget what was marked during it.
    pub fn admitted(&mut self) {
        self.marked_during_claim.clear();
    }

    /// The row was marked dead while a claim ran: that claim must not hand it out.
    pub fn buried(&mut self, seq: i64) {
        self.held.remove(&seq);
        if self.claim_running {
            self.marked_during_claim.insert(seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_that_fills_its_share_is_asked_for_more_up_to_the_batch() {
        let mut c = Claims::new();
        let plan = c.plan(vec![0, 1], 100);
        assert_eq!(
            plan.limits,
            vec![100, 100],
            "two partitions share 2 x batch"
        );
        let plan = c.plan((0..64).collect(), 100);
        assert_eq!(plan.limits[0], 8, "never below 8");
        let counts = HashMap::from([(0, 8), (1, 2)]);
        assert!(c.returned(&plan, Some(&counts), 100));
        let plan = c.plan((0..64).collect(), 100);
        assert_eq!((plan.limits[0], plan.limits[1]), (16, 8));
        for _ in 0..4 {
            let plan = c.plan((0..64).collect(), 100);
            c.returned(&plan, Some(&HashMap::from([(0, plan.limits[0])])), 100);
        }
        let plan = c.plan((0..64).collect(), 100);
        assert_eq!(plan.limits[0], 100, "capped at the batch");
        c.returned(&plan, Some(&HashMap::from([(0, 3)])), 100);
        assert_eq!(
            c.plan((0..64).collect(), 100).limits[0],
            8,
            "back to the base"
        );
    }

    #[test]
    fn a_claim_that_started_before_a_give_back_is_dropped() {
        let mut c = Claims::new();
        c.hold(5, 0);
        let plan = c.plan(vec![0], 10);
        c.gave_back([5]);
        assert!(!c.returned(&plan, Some(&HashMap::from([(0, 1)])), 10));
        assert!(c.more, "claimed again at once");
        assert!(!c.is_held(5));
    }

    #[test]
    fn rows_marked_during_a_claim_are_not_handed_out_again() {
        let mut c = Claims::new();
        c.hold(5, 0);
        let plan = c.plan(vec![0], 10);
        assert!(plan.held.contains(&5));
        c.marked(&[5]);
        assert!(c.returned(&plan, Some(&HashMap::from([(0, 1)])), 10));
        assert_eq!(c.admit(5), Admit::Known);
        assert_eq!(c.admit(6), Admit::Take);
        c.admitted();
        assert_eq!(
            c.admit(5),
            Admit::Take,
            "a later claim may see it if it is still there"
        );
    }

    #[test]
    fn an_empty_claim_waits_for_a_wake_up() {
        let mut c = Claims::new();
        let plan = c.plan(vec![0], 10);
        assert!(!c.more);
        assert!(c.returned(&plan, Some(&HashMap::new()), 10));
        assert!(!c.more);
    }
}
