//! Where each owned partition's claim starts, and which transactions may still commit rows
//! below that start (issue 39).
//!
//! A claim used to read each partition from the start of `messages_claim_idx`. While a snapshot
//! older than the published rows is held anywhere in the database, their index entries cannot be
//! marked dead, and every claim walked them again: claim time grew with the rows published since
//! the snapshot began. Now a claim reads each partition past its **floor**: the highest seq this
//! relay has claimed there, lowered below any row it gave back unpublished (a failed publish, a
//! lost link), so a row given back is read again.
//!
//! A row's seq is taken at INSERT, not at commit, so a row can become visible below a floor the
//! relay has passed. Its transaction was running when the claim that passed it took its snapshot
//! (a transaction that commits before the snapshot is seen by the claim, one that starts after it
//! takes higher seqs... or lower ones, if another running transaction took seqs after it began:
//! hence "running at the snapshot or started after it"). So each claim first takes a snapshot
//! (`pg_current_snapshot()`), and the next claims also ask for the pending rows of its running
//! transactions and of every transaction from its `xmax` on (`txid`, migration 23: point lookups,
//! however old the oldest snapshot). A claim that came back full may have left such rows for
//! later: then the watch keeps what it watched before as well.
//!
//! A partition this relay takes over (again) starts from the beginning once: another relay may
//! have given rows back there.

use std::collections::{BTreeSet, HashMap, HashSet};

/// A snapshot as `pg_current_snapshot()` writes it: `xmin:xmax:xip,xip,...`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Snapshot {
    pub xmax: u64,
    pub running: Vec<u64>,
}

impl Snapshot {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(':');
        let _xmin: u64 = parts.next()?.parse().ok()?;
        let xmax: u64 = parts.next()?.parse().ok()?;
        let running = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?,
        };
        Some(Self { xmax, running })
    }
}

/// The transactions whose rows may still appear below the floors: the running ones of a
/// snapshot, and every one from its `xmax` on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Watch {
    running: BTreeSet<u64>,
    from: Option<u64>,
}

#[derive(Debug, Default)]
struct Part {
    /// The highest seq claimed here (the forward read starts past it).
    passed: i64,
    /// Rows given back unpublished: the floor stays below them until they are read again.
    returned: BTreeSet<i64>,
}

#[derive(Debug, Default)]
pub(crate) struct Positions {
    parts: HashMap<i16, Part>,
    watch: Watch,
}

/// What a claim asks of the positions: each partition's floor, and the watched transactions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LateArgs {
    pub running: Vec<String>,
    pub from: Option<String>,
}

impl Positions {
    /// The floor of each of `partitions`: the forward read takes seqs above it.
    pub(crate) fn floors(&self, partitions: &[i16]) -> Vec<i64> {
        partitions
            .iter()
            .map(|p| match self.parts.get(p) {
                None => 0,
                Some(part) => match part.returned.first() {
                    Some(r) => part.passed.min(r - 1),
                    None => part.passed,
                },
            })
            .collect()
    }

    pub(crate) fn late(&self) -> LateArgs {
        LateArgs {
            running: self.watch.running.iter().map(u64::to_string).collect(),
            from: self.watch.from.map(|x| x.to_string()),
        }
    }

    /// A claim of `plan` (partitions, rows asked of each, rows in all) returned `rows`
    /// (partition, seq) after taking `snapshot`. `held` says which rows this relay holds now.
    pub(crate) fn claimed(
        &mut self,
        plan: (&[i16], &[i64], i64),
        floors: &[i64],
        rows: &[(i16, i64)],
        snapshot: &Snapshot,
        held: impl Fn(i64) -> bool,
    ) {
        let (partitions, _asked, limit) = plan;
        let full = rows.len() as i64 >= limit;
        let mut by_part: HashMap<i16, Vec<i64>> = HashMap::new();
        for (p, s) in rows {
            by_part.entry(*p).or_default().push(*s);
        }
        for (p, floor) in partitions.iter().zip(floors) {
            let got = by_part.remove(p).unwrap_or_default();
            let forward: Vec<i64> = got.iter().copied().filter(|s| s > floor).collect();
            let part = self.parts.entry(*p).or_default();
            let got: HashSet<i64> = got.into_iter().collect();
            // Every pending row above the floor up to the highest one read was returned (or is
            // held): a row given back below that and not returned is settled (published by
            // another relay, deleted). Nothing read proves nothing (the partition may have been
            // blocked): the rows given back keep the floor below them.
            let through = forward.iter().copied().max().unwrap_or(i64::MIN);
            part.returned
                .retain(|r| !got.contains(r) && (*r > through || held(*r)));
            if let Some(m) = forward.iter().copied().max() {
                part.passed = part.passed.max(m);
            }
        }
        let next = Watch {
            running: snapshot.running.iter().copied().collect(),
            from: Some(snapshot.xmax),
        };
        self.watch = if full {
            Watch {
                running: &self.watch.running | &next.running,
                from: match self.watch.from {
                    Some(old) => Some(old.min(snapshot.xmax)),
                    None => next.from,
                },
            }
        } else {
            next
        };
    }

    /// Row `seq` of `partition` went back to the outbox unpublished.
    pub(crate) fn returned(&mut self, partition: i16, seq: i64) {
        if let Some(part) = self.parts.get_mut(&partition) {
            part.returned.insert(seq);
        }
    }

    /// This relay took `partition` over (again): read it from the start.
    pub(crate) fn forget(&mut self, partition: i16) {
        self.parts.remove(&partition);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(xmax: u64, running: &[u64]) -> Snapshot {
        Snapshot {
            xmax,
            running: running.to_vec(),
        }
    }

    #[test]
    fn a_snapshot_parses_with_and_without_running_transactions() {
        assert_eq!(Snapshot::parse("10:12:"), Some(snap(12, &[])));
        assert_eq!(Snapshot::parse("10:15:10,13"), Some(snap(15, &[10, 13])));
        assert_eq!(Snapshot::parse("nonsense"), None);
    }

    #[test]
    fn the_floor_follows_the_claimed_rows_and_stays_below_a_row_given_back() {
        let mut p = Positions::default();
        assert_eq!(
            p.floors(&[3]),
            vec![0],
            "a new partition is read from the start"
        );
        p.claimed(
            (&[3], &[10], 100),
            &[0],
            &[(3, 5), (3, 7), (3, 9)],
            &snap(20, &[]),
            |_| true,
        );
        assert_eq!(p.floors(&[3]), vec![9]);
        p.returned(3, 7);
        assert_eq!(p.floors(&[3]), vec![6], "the row given back is read again");
        // The next claim reads 7 again: the floor moves on.
        p.claimed(
            (&[3], &[10], 100),
            &[6],
            &[(3, 7), (3, 12)],
            &snap(21, &[]),
            |_| true,
        );
        assert_eq!(p.floors(&[3]), vec![12]);
    }

    #[test]
    fn a_row_given_back_holds_the_floor_until_a_read_passes_it() {
        let mut p = Positions::default();
        p.claimed((&[1], &[10], 100), &[0], &[(1, 4)], &snap(5, &[]), |_| true);
        p.returned(1, 4);
        // Nothing read (the partition was blocked, say): row 4 may still be there.
        p.claimed((&[1], &[10], 100), &[3], &[], &snap(6, &[]), |_| false);
        assert_eq!(p.floors(&[1]), vec![3]);
        // A read from 3 that returned 9 but not 4: row 4 is settled (published elsewhere).
        p.claimed((&[1], &[10], 100), &[3], &[(1, 9)], &snap(7, &[]), |_| {
            false
        });
        assert_eq!(p.floors(&[1]), vec![9]);
    }

    #[test]
    fn the_watch_is_the_last_snapshot_or_grows_while_claims_come_back_full() {
        let mut p = Positions::default();
        assert_eq!(
            p.late(),
            LateArgs {
                running: vec![],
                from: None
            }
        );
        p.claimed(
            (&[0], &[1], 1),
            &[0],
            &[(0, 1)],
            &snap(50, &[40, 45]),
            |_| true,
        );
        p.claimed(
            (&[0], &[1], 1),
            &[1],
            &[(0, 2)],
            &snap(60, &[45, 55]),
            |_| true,
        );
        assert_eq!(
            p.late(),
            LateArgs {
                running: vec!["40".into(), "45".into(), "55".into()],
                from: Some("50".into())
            },
            "a full claim may have left rows of what it watched"
        );
        p.claimed((&[0], &[5], 5), &[2], &[(0, 3)], &snap(70, &[65]), |_| true);
        assert_eq!(
            p.late(),
            LateArgs {
                running: vec!["65".into()],
                from: Some("70".into())
            }
        );
    }

    #[test]
    fn a_partition_taken_over_again_is_read_from_the_start() {
        let mut p = Positions::default();
        p.claimed((&[2], &[10], 100), &[0], &[(2, 30)], &snap(5, &[]), |_| {
            true
        });
        p.forget(2);
        assert_eq!(p.floors(&[2]), vec![0]);
    }
}
