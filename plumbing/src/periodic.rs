//! Work done on a timer of its own (gauges, backlogs), so the loop that does the real work never
//! waits on it: the relay's backlog and unrouted-queue gauges, the process worker's status
//! gauges.

use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// One refresh of something periodic; it keeps its state (a connection, what it has seen) from
/// one refresh to the next. A failure is the refresh's own to log: the next one tries again.
pub trait Refresh {
    /// Refreshes once.
    fn refresh(&mut self) -> impl Future<Output = ()> + Send;
}

/// A refresh may take at most 1 / `COST_FACTOR` of the time from one refresh to the next.
pub const COST_FACTOR: u32 = 20;
/// However long a refresh took, the next one comes after at most this many intervals: a refresh
/// that waited out an outage (a 35 s database timeout, an AMQP reconnect) must not leave the
/// gauges stale for minutes after it ends.
pub const MAX_INTERVALS: u32 = 12;

/// Refreshes `task` at once and then every `interval` until `stop`, and hands it back (to close
/// what it holds). A refresh that took longer than `interval / COST_FACTOR` spaces the next one
/// out to `COST_FACTOR` times its duration, at most `MAX_INTERVALS` intervals: gauges that count rows (a relay's backlog, processes
/// by status) grow with the table, and must not take a database core exactly when the table is
/// large.
pub async fn every<R: Refresh>(interval: Duration, stop: &CancellationToken, mut task: R) -> R {
    loop {
        let started = tokio::time::Instant::now();
        task.refresh().await;
        tokio::select! {
            _ = tokio::time::sleep(next_wait(interval, started.elapsed())) => {}
            _ = stop.cancelled() => return task,
        }
    }
}

/// The wait before the next refresh: the interval, or longer after a refresh that took long.
fn next_wait(interval: Duration, took: Duration) -> Duration {
    interval
        .max(took * COST_FACTOR)
        .min(interval * MAX_INTERVALS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_refresh_spaces_the_next_one_out_a_fast_one_keeps_the_interval() {
        let every = Duration::from_secs(5);
        assert_eq!(next_wait(every, Duration::from_millis(30)), every);
        assert_eq!(
            next_wait(every, Duration::from_millis(600)),
            Duration::from_secs(12)
        );
        assert_eq!(
            next_wait(every, Duration::from_secs(35)),
            Duration::from_secs(60),
            "a refresh that waited out an outage is followed within 12 intervals"
        );
    }
}
