//! Weighted fair share by a key the application names (a tenant header), in unordered mode.
//!
//! RabbitMQ delivers a queue in order, so a consumer cannot pick its next message by key: one
//! tenant's burst of 10,000 messages sits in front of everybody else's. With a fair share the
//! consumer sorts its queue into *lanes* and works the lanes side by side:
//!
//! ```text
//! NAME --(sorting workers: a copy to the key's lane, then ack)--> NAME.fair.0 .. NAME.fair.<K-1>
//!                                                                 NAME.fair.key.<key>  (named keys)
//! each lane --(its own workers: handler, dedup, ack after commit)--> effects
//! ```
//!
//! - A key named with a weight gets a lane of its own, worked by `weight` workers; every other key
//!   goes to one of `K` hashed lanes (a stable hash of the key), each worked by one worker. A
//!   burst fills its own lane; the other lanes' workers go on, so the others' messages wait for
//!   their own lane only. Keys that hash to the burst's lane share its turn: name a key that
//!   matters, or raise the lanes.
//! - Sorting costs a publish (confirmed) and an ack per message, far less than a handler: the
//!   sorting workers walk a burst at the broker's speed.
//! - A sorted copy keeps the message's id, headers, attempt and original routing key;
//!   deduplication by message id makes a copy sorted twice (a crash between publish and ack)
//!   harmless. Retries and replays come back through the main queue and are sorted again.
//!
//! Unordered mode only (a lane would reorder an aggregate across lanes; the setting is refused
//! in ordered mode, which shares by partition).

use shared::Envelope;
use std::collections::BTreeMap;

/// The key, lanes and weights of a consumer's fair share.
#[derive(Debug, Clone)]
pub struct FairShare {
    header: String,
    lanes: u16,
    weights: BTreeMap<String, u16>,
}

/// A lane: the queue it is and how many workers work it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    pub queue: String,
    pub workers: u16,
}

impl FairShare {
    /// Shares by the message header `header` (e.g. `tenant`): a string or a number. Messages
    /// without it go to the hashed lane of the empty key. Eight hashed lanes by default.
    pub fn by_header(header: impl Into<String>) -> Self {
        Self {
            header: header.into(),
            lanes: 8,
            weights: BTreeMap::new(),
        }
    }
    /// `key` gets a lane of its own worked by `weight` workers (the other keys' lanes have one
    /// each): with `b` at weight 2 and everyone busy, `b` gets twice a hashed lane's work.
    pub fn weight(mut self, key: impl Into<String>, weight: u16) -> Self {
        self.weights.insert(key.into(), weight);
        self
    }
    /// How many hashed lanes the keys without a weight are spread over (1 to 64).
    pub fn lanes(mut self, lanes: u16) -> Self {
        self.lanes = lanes;
        self
    }
    /// The header the key is read from.
    pub fn header(&self) -> &str {
        &self.header
    }
    /// The rule a setting breaks, if any.
    pub fn check(&self) -> Result<(), String> {
        if self.header.is_empty() {
            return Err("the fair share's header must be named".into());
        }
        if !(1..=64).contains(&self.lanes) {
            return Err(format!(
                "fair share lanes must be 1 to 64, not {}",
                self.lanes
            ));
        }
        for (k, w) in &self.weights {
            if !(1..=16).contains(w) {
                return Err(format!(
                    "the weight of fair key {k:?} must be 1 to 16, not {w}"
                ));
            }
            if k.is_empty()
                || k.len() > 100
                || !k
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
            {
                return Err(format!(
                    "fair key {k:?} cannot name a lane: use 1-100 characters of A-Z a-z 0-9 . _ -"
                ));
            }
        }
        Ok(())
    }
    /// Every lane of consumer `name`: the hashed ones, then one per named key.
    pub fn all_lanes(&self, name: &str) -> Vec<Lane> {
        let hashed = (0..self.lanes).map(|i| Lane {
            queue: format!("{name}.fair.{i}"),
            workers: 1,
        });
        let named = self.weights.iter().map(|(k, w)| Lane {
            queue: format!("{name}.fair.key.{k}"),
            workers: *w,
        });
        hashed.chain(named).collect()
    }
    /// Workers over all lanes.
    pub fn lane_workers(&self) -> usize {
        usize::from(self.lanes)
            + self
                .weights
                .values()
                .map(|w| usize::from(*w))
                .sum::<usize>()
    }
    /// The message's key: its header, or "".
    pub fn key_of(&self, env: &Envelope) -> String {
        match env.headers.get(&self.header) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => String::new(),
        }
    }
    /// The lane queue of `key` for consumer `name`.
    pub fn lane_of(&self, name: &str, key: &str) -> String {
        if self.weights.contains_key(key) {
            return format!("{name}.fair.key.{key}");
        }
        format!(
            "{name}.fair.{}",
            fnv1a(key.as_bytes()) % u64::from(self.lanes)
        )
    }
}

/// FNV-1a (64 bits): a stable hash, the same in every instance and version, so a key's lane
/// never moves while its messages wait in it.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_key_has_its_own_lane_and_the_others_hash_stably() {
        let f = FairShare::by_header("tenant").lanes(4).weight("big", 3);
        assert_eq!(f.lane_of("c", "big"), "c.fair.key.big");
        let a = f.lane_of("c", "acme");
        assert_eq!(a, f.lane_of("c", "acme"), "stable");
        assert!(a.starts_with("c.fair.") && !a.contains("key"));
        // The hash is fixed: the same lane in every instance and release.
        assert_eq!(fnv1a(b"acme"), 0x0724_d383_f4f6_de0f, "FNV-1a of \"acme\"");
        let lanes = f.all_lanes("c");
        assert_eq!(lanes.len(), 5);
        assert_eq!(
            lanes[4],
            Lane {
                queue: "c.fair.key.big".into(),
                workers: 3
            }
        );
        assert_eq!(f.lane_workers(), 7);
    }

    #[test]
    fn keys_spread_over_the_hashed_lanes() {
        let f = FairShare::by_header("tenant").lanes(8);
        let mut used = std::collections::HashSet::new();
        for i in 0..200 {
            used.insert(f.lane_of("c", &format!("tenant-{i}")));
        }
        assert_eq!(used.len(), 8);
    }

    #[test]
    fn settings_that_cannot_work_are_refused() {
        assert!(FairShare::by_header("").check().is_err());
        assert!(FairShare::by_header("t").lanes(0).check().is_err());
        assert!(FairShare::by_header("t").weight("x", 0).check().is_err());
        assert!(FairShare::by_header("t").weight("a b", 2).check().is_err());
        assert!(FairShare::by_header("t").weight("x", 3).check().is_ok());
    }
}
