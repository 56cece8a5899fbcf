//! Instances that share partitions through leases (the relay's outbox partitions, an ordered
//! consumer's partition queues): who they are, and how many partitions each should hold.

/// The machine's host name (`/proc/sys/kernel/hostname`; `unknown` elsewhere).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// A fresh instance id, `host-xxxxxxxx`: unique per start, readable in the console and logs.
pub fn instance_id() -> String {
    format!("{}-{:08x}", hostname(), rand::random::<u32>())
}

/// How many of `partitions` the instance at `rank` (its place among the `live` ones, sorted by
/// id) should hold: `partitions / live`, one more for the first `partitions % live`. The shares
/// add up to `partitions` and differ by at most one, so every live instance gets work when there
/// is enough (a plain `ceil(partitions / live)` for all leaves the last ones with nothing: 9
/// instances on 64 partitions take 8 each and the ninth none).
pub fn fair_share(partitions: i64, live: i64, rank: i64) -> i64 {
    let live = live.max(1);
    partitions / live + i64::from(rank < partitions % live)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        for partitions in 1..=64 {
            for live in 1..=10 {
                let shares: Vec<i64> = (0..live).map(|r| fair_share(partitions, live, r)).collect();
                assert_eq!(
                    shares.iter().sum::<i64>(),
                    partitions,
                    "{partitions}/{live}"
                );
                let spread = shares.iter().max().unwrap() - shares.iter().min().unwrap();
                assert!(spread <= 1, "{partitions}/{live}: {shares:?}");
            }
        }
        assert_eq!(fair_share(4, 3, 0), 2);
        assert_eq!(fair_share(4, 3, 2), 1);
        assert_eq!(fair_share(64, 9, 8), 7, "the ninth relay gets its share");
    }
}
