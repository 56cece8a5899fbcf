//! Which owned partitions may be claimed and sent now.

use std::collections::{HashMap, HashSet};
use tokio::time::Instant;

#[derive(Default)]
pub(super) struct Gate {
    /// Partitions with a refused row: nothing of theirs is claimed or sent before this time.
    blocked: HashMap<i16, Instant>,
    /// Partitions being given back for rebalancing: not claimed, released once nothing of theirs
    /// is held.
    releasing: HashSet<i16>,
}

impl Gate {
    pub fn block(&mut self, partition: i16, until: Instant) {
        self.blocked.insert(partition, until);
    }

    /// Whether rows of `partition` may be taken now.
    pub fn is_open(&self, partition: i16, now: Instant) -> bool {
        self.blocked.get(&partition).is_none_or(|t| *t <= now)
            && !self.releasing.contains(&partition)
    }

    /// Keeps the partitions of `owned` that may be claimed now.
    pub fn open(&mut self, mut owned: Vec<i16>, now: Instant) -> Vec<i16> {
        self.blocked.retain(|_, until| *until > now);
        owned.retain(|p| self.is_open(*p, now));
        owned
    }

    pub fn start_releasing(&mut self, partitions: impl IntoIterator<Item = i16>) {
        self.releasing.extend(partitions);
    }

    pub fn is_releasing(&self) -> bool {
        !self.releasing.is_empty()
    }

    /// Partitions being released that hold nothing any more (`busy` holds rows).
    pub fn releasable(&self, busy: &HashSet<i16>) -> Vec<i16> {
        self.releasing
            .iter()
            .copied()
            .filter(|p| !busy.contains(p))
            .collect()
    }

    pub fn released(&mut self, partitions: &[i16]) {
        for p in partitions {
            self.releasing.remove(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn blocked_and_releasing_partitions_are_not_claimed() {
        let now = Instant::now();
        let mut g = Gate::default();
        g.block(1, now + Duration::from_secs(1));
        g.start_releasing([2]);
        assert_eq!(g.open(vec![0, 1, 2, 3], now), vec![0, 3]);
        assert_eq!(
            g.open(vec![0, 1, 2, 3], now + Duration::from_secs(2)),
            vec![0, 1, 3],
            "a block ends"
        );
        assert_eq!(g.releasable(&HashSet::from([2])), Vec::<i16>::new());
        assert_eq!(g.releasable(&HashSet::new()), vec![2]);
        g.released(&[2]);
        assert!(g.is_open(2, now));
    }
}
