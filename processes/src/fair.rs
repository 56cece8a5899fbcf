//! Weighted fair share: when many processes are due, a worker with a [`FairShare`] claims the
//! due processes of each fair key ([`crate::Definition::fair_key`]: a tenant, a merchant) in turn,
//! by weight, instead of strictly oldest first, so one key's burst cannot starve the others.
//!
//! It is stride scheduling: each key has a *pass* that grows by `1 / weight` for every process
//! of it the worker claims, and a claim takes the rows with the lowest `pass + rank / weight`
//! (rank 1 for the key's oldest due row). A key that was idle, or is new, enters at the worker's
//! *virtual time* (the lowest pass of the busy keys), so idleness banks no credit. The passes live
//! in the worker's memory: each worker is fair on its own, so all together are fair too, and the
//! claim writes nothing more than it did.
//!
//! The claim walks the distinct due keys with a skip scan, at most [`FairShare::keys_per_claim`]
//! of them, resuming after the last one where it stopped, so that every key comes up even when
//! there are more keys than a claim looks at.

use std::collections::HashMap;

/// The weights of a fair share. A key without a weight of its own has the default (1).
#[derive(Debug, Clone)]
pub struct FairShare {
    weights: HashMap<String, f64>,
    default_weight: f64,
    keys_per_claim: usize,
}

impl Default for FairShare {
    fn default() -> Self {
        Self {
            weights: HashMap::new(),
            default_weight: 1.0,
            keys_per_claim: 256,
        }
    }
}

/// A fair share the worker cannot run with.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FairShareError {
    #[error("the weight of fair key {0:?} must be at least 1")]
    Weight(String),
    #[error("the default weight must be at least 1")]
    DefaultWeight,
    #[error("keys_per_claim must be between 1 and 10000")]
    KeysPerClaim,
}

impl FairShare {
    pub fn new() -> Self {
        Self::default()
    }
    /// `key` gets `weight` shares: with weights 3, 1 and 1, and all three keys busy, it gets 3/5
    /// of the claims.
    pub fn weight(mut self, key: impl Into<String>, weight: u32) -> Self {
        self.weights.insert(key.into(), f64::from(weight));
        self
    }
    /// The weight of every key not named (1 unless set).
    pub fn default_weight(mut self, weight: u32) -> Self {
        self.default_weight = f64::from(weight);
        self
    }
    /// Most distinct keys one claim looks at (256 by default); more keys are taken up by the
    /// next claims, in key order.
    pub fn keys_per_claim(mut self, n: usize) -> Self {
        self.keys_per_claim = n;
        self
    }
    /// Refuses a weight of 0 (a key that never runs) and an unbounded key walk.
    pub fn check(&self) -> Result<(), FairShareError> {
        if let Some((k, _)) = self.weights.iter().find(|(_, w)| **w < 1.0) {
            return Err(FairShareError::Weight(k.clone()));
        }
        if self.default_weight < 1.0 {
            return Err(FairShareError::DefaultWeight);
        }
        if !(1..=10_000).contains(&self.keys_per_claim) {
            return Err(FairShareError::KeysPerClaim);
        }
        Ok(())
    }
    pub(crate) fn keys_per_claim_limit(&self) -> usize {
        self.keys_per_claim
    }
    pub(crate) fn default_weight_value(&self) -> f64 {
        self.default_weight
    }
    /// The named weights as parallel arrays, for the claim.
    pub(crate) fn weight_arrays(&self) -> (Vec<String>, Vec<f64>) {
        self.weights.iter().map(|(k, w)| (k.clone(), *w)).unzip()
    }
}

/// A worker's memory of what it claimed: the pass of each key ahead of the virtual time, and
/// where the key walk resumes. `None` is the group of processes without a key.
#[derive(Debug, Default)]
pub(crate) struct Passes {
    virtual_time: f64,
    passes: HashMap<Option<String>, f64>,
    /// The walk of the keys resumes after this one (empty: from the start).
    cursor: String,
}

impl Passes {
    pub(crate) fn virtual_time(&self) -> f64 {
        self.virtual_time
    }
    pub(crate) fn cursor(&self) -> &str {
        &self.cursor
    }
    /// The passes of the keys ahead of the virtual time, as parallel arrays for the claim (a key
    /// not listed is at the virtual time).
    pub(crate) fn arrays(&self) -> (Vec<Option<String>>, Vec<f64>) {
        self.passes.iter().map(|(k, p)| (k.clone(), *p)).unzip()
    }

    /// After a claim: each claimed key's pass moves to the turn of its last claimed row; a key
    /// the walk found that has no pass yet enters at the virtual time (and keeps that pass while
    /// it waits, so it cannot drift behind the others); keys the walk did not find are idle and
    /// forgotten (they bank nothing). The virtual time becomes the lowest pass of the keys found
    /// (never going back). `groups` are the groups the walk found (`None`: without a key), `limit`
    /// how many keys a walk looks at: a walk that hit it resumes after its last key next time, one
    /// that did not starts over.
    pub(crate) fn after_claim(
        &mut self,
        claimed: &[(Option<String>, f64)],
        groups: &[Option<String>],
        limit: usize,
    ) {
        let vt = self.virtual_time;
        let mut next: HashMap<Option<String>, f64> = groups
            .iter()
            .map(|g| (g.clone(), self.passes.get(g).copied().unwrap_or(vt).max(vt)))
            .collect();
        for (key, turn) in claimed {
            let pass = next.entry(key.clone()).or_insert(*turn);
            *pass = pass.max(*turn);
        }
        if let Some(lowest) = next.values().copied().reduce(f64::min) {
            self.virtual_time = vt.max(lowest);
        }
        self.passes = next;
        let keyed = groups.iter().filter(|g| g.is_some()).count();
        self.cursor = match groups.iter().flatten().max() {
            Some(k) if keyed >= limit => k.clone(),
            _ => String::new(),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The claim's order, in Rust: the rows with the lowest `max(pass, virtual time) + rank /
    /// weight`, ties by key. Used to check that the passes give each busy key its weight's share.
    fn claim(p: &Passes, weights: &[(&str, f64)], n: usize) -> Vec<(Option<String>, f64)> {
        let mut turns = Vec::new();
        for (k, w) in weights {
            let key = Some(k.to_string());
            let pass = p.passes.get(&key).copied().unwrap_or(p.virtual_time);
            let pass = pass.max(p.virtual_time);
            for rank in 1..=n {
                turns.push((key.clone(), pass + rank as f64 / w));
            }
        }
        turns.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        turns.truncate(n);
        turns
    }

    fn groups(weights: &[(&str, f64)]) -> Vec<Option<String>> {
        weights.iter().map(|(k, _)| Some(k.to_string())).collect()
    }

    fn shares(weights: &[(&str, f64)], claim_size: usize, claims: usize) -> HashMap<String, usize> {
        let mut p = Passes::default();
        let mut got = HashMap::new();
        for _ in 0..claims {
            let c = claim(&p, weights, claim_size);
            for (k, _) in &c {
                *got.entry(k.clone().unwrap()).or_insert(0) += 1;
            }
            p.after_claim(&c, &groups(weights), 256);
        }
        got
    }

    #[test]
    fn busy_keys_get_their_weights_share_whatever_the_claim_size() {
        for size in [1, 2, 7, 32] {
            let got = shares(&[("a", 3.0), ("b", 1.0), ("c", 1.0)], size, 500);
            let total: usize = got.values().sum();
            let a = got["a"] as f64 / total as f64;
            let b = got["b"] as f64 / total as f64;
            assert!((a - 0.6).abs() < 0.02, "claim size {size}: a got {a}");
            assert!((b - 0.2).abs() < 0.02, "claim size {size}: b got {b}");
        }
    }

    #[test]
    fn an_idle_key_banks_no_credit_and_a_new_key_enters_at_the_virtual_time() {
        let mut p = Passes::default();
        for _ in 0..100 {
            let c = claim(&p, &[("a", 1.0)], 4);
            p.after_claim(&c, &groups(&[("a", 1.0)]), 256);
        }
        // b arrives after a ran alone for 400 claims' worth: it must not get the next 400.
        let mut b = 0;
        for _ in 0..10 {
            let c = claim(&p, &[("a", 1.0), ("b", 1.0)], 4);
            b += c.iter().filter(|(k, _)| k.as_deref() == Some("b")).count();
            p.after_claim(&c, &groups(&[("a", 1.0), ("b", 1.0)]), 256);
        }
        assert!((18..=22).contains(&b), "b got {b} of 40");
        let c = claim(&p, &[("b", 1.0)], 4);
        p.after_claim(&c, &groups(&[("b", 1.0)]), 256);
        assert!(
            !p.passes.contains_key(&Some("a".into())),
            "an idle key is forgotten"
        );
    }

    #[test]
    fn a_walk_that_hit_its_limit_resumes_after_its_last_key() {
        let mut p = Passes::default();
        let walk = |ks: &[&str]| ks.iter().map(|k| Some(k.to_string())).collect::<Vec<_>>();
        p.after_claim(&[], &walk(&["k1", "k2", "k3"]), 3);
        assert_eq!(p.cursor(), "k3");
        p.after_claim(&[], &walk(&["k4", "k9"]), 3);
        assert_eq!(p.cursor(), "", "a short walk saw every key: start over");
    }

    #[test]
    fn a_weight_of_zero_is_refused() {
        assert_eq!(
            FairShare::new().weight("t", 0).check(),
            Err(FairShareError::Weight("t".into()))
        );
        assert_eq!(
            FairShare::new().default_weight(0).check(),
            Err(FairShareError::DefaultWeight)
        );
        assert!(FairShare::new().weight("t", 5).check().is_ok());
    }
}
