//! What a queue observer sees of each aggregate, by `aggregate_seq`, checked against the README's
//! table "What a consumer can observe".

use crate::Received;
use std::collections::{BTreeMap, HashSet};

/// The `aggregate_seq` header of a delivery.
pub fn aggregate_seq(r: &Received) -> Option<i64> {
    let h = r.properties.headers().as_ref()?;
    plumbing::amqp::header_i64(h, plumbing::amqp::headers::AGGREGATE_SEQ)
}

/// The deliveries of each aggregate (header `aggregate_id`), as sequence numbers in arrival order.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    pub by_aggregate: BTreeMap<String, Vec<i64>>,
}

impl Observed {
    pub fn new(received: &[Received]) -> Self {
        let mut by_aggregate: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for r in received {
            let aggregate = r.header("aggregate_id").unwrap_or_default();
            let seq = aggregate_seq(r)
                .unwrap_or_else(|| panic!("delivery {} has no aggregate_seq", r.message_id));
            by_aggregate.entry(aggregate).or_default().push(seq);
        }
        Self { by_aggregate }
    }

    /// `1 2 4 3 4`: the pattern of one aggregate, as the README's table writes it.
    pub fn pattern(&self, aggregate: &str) -> String {
        self.by_aggregate
            .get(aggregate)
            .map(|s| {
                s.iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    }

    /// Nothing lost: every aggregate's numbers `1..=n` arrived (`missing` lists the dead ones).
    pub fn assert_complete(
        &self,
        expected: &BTreeMap<String, i64>,
        missing: &HashSet<(String, i64)>,
    ) {
        for (aggregate, n) in expected {
            let seen: HashSet<i64> = self
                .by_aggregate
                .get(aggregate)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            for k in 1..=*n {
                let dead = missing.contains(&(aggregate.clone(), k));
                assert_eq!(
                    seen.contains(&k),
                    !dead,
                    "aggregate {aggregate}: message {k} {} (saw {})",
                    if dead {
                        "is dead but arrived"
                    } else {
                        "never arrived"
                    },
                    self.pattern(aggregate)
                );
            }
        }
    }

    /// Every message's last copy is in order: after the last copy of `k`, nothing below `k`.
    pub fn assert_last_copies_in_order(&self) {
        for (aggregate, seqs) in &self.by_aggregate {
            let mut last_pos = BTreeMap::new();
            for (i, s) in seqs.iter().enumerate() {
                last_pos.insert(*s, i);
            }
            let positions: Vec<usize> = last_pos.values().copied().collect();
            assert!(
                positions.windows(2).all(|w| w[0] < w[1]),
                "aggregate {aggregate}: last copies out of order: {}",
                self.pattern(aggregate)
            );
        }
    }

    /// Only resends (link cut, confirm timeout, relay killed, channel closed): the first copies
    /// are in order, so whatever arrives out of order is a copy of something already seen.
    pub fn assert_only_resends(&self) {
        for (aggregate, seqs) in &self.by_aggregate {
            let mut seen = HashSet::new();
            let mut high = 0;
            for s in seqs {
                if seen.insert(*s) {
                    assert!(
                        *s > high,
                        "aggregate {aggregate}: {s} arrived first after {high}: {}",
                        self.pattern(aggregate)
                    );
                    high = *s;
                }
            }
        }
    }

    /// Refusals (nack, return): a copy overtakes earlier messages only when the first of them was
    /// refused (`refused`: each aggregate's refused numbers): the relay sends the refused message
    /// and everything after it again, in order, so every last copy is in order.
    pub fn assert_overtaken_only_by_refusals(&self, refused: &HashSet<(String, i64)>) {
        for (aggregate, seqs) in &self.by_aggregate {
            let mut last = BTreeMap::new();
            for (i, s) in seqs.iter().enumerate() {
                last.insert(*s, i);
            }
            for (i, s) in seqs.iter().enumerate() {
                // The earliest message this copy overtook: one whose last copy comes later.
                let overtaken = last.range(..*s).find(|(_, at)| **at > i).map(|(k, _)| *k);
                if let Some(k) = overtaken {
                    assert!(
                        refused.contains(&(aggregate.clone(), k)),
                        "aggregate {aggregate}: {s} overtook {k}, which was not refused: {}",
                        self.pattern(aggregate)
                    );
                }
            }
        }
        self.assert_last_copies_in_order();
    }

    /// How many deliveries arrived more than once.
    pub fn copies(&self) -> usize {
        self.by_aggregate
            .values()
            .map(|s| s.len() - s.iter().collect::<HashSet<_>>().len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(seqs: &[i64]) -> Observed {
        Observed {
            by_aggregate: BTreeMap::from([("a".to_string(), seqs.to_vec())]),
        }
    }

    #[test]
    fn the_table_patterns_pass_their_checks() {
        observed(&[1, 2, 3, 2, 3, 4]).assert_only_resends();
        observed(&[1, 2, 3, 2, 3, 4]).assert_last_copies_in_order();
        let refused = HashSet::from([("a".to_string(), 3)]);
        observed(&[1, 2, 4, 3, 4]).assert_overtaken_only_by_refusals(&refused);
        assert_eq!(observed(&[1, 2, 4, 3, 4]).pattern("a"), "1 2 4 3 4");
        assert_eq!(observed(&[1, 2, 4, 3, 4]).copies(), 1);
    }

    #[test]
    #[should_panic(expected = "last copies out of order")]
    fn an_overtaker_that_is_not_sent_again_fails() {
        let refused = HashSet::from([("a".to_string(), 3)]);
        observed(&[1, 2, 4, 3]).assert_overtaken_only_by_refusals(&refused);
    }

    #[test]
    #[should_panic(expected = "arrived first after")]
    fn a_reorder_is_not_a_resend() {
        observed(&[1, 3, 2]).assert_only_resends();
    }
}
