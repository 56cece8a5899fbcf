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

/// Refreshes `task` at once and then every `interval` until `stop`, and hands it back (to close
/// what it holds).
pub async fn every<R: Refresh>(interval: Duration, stop: &CancellationToken, mut task: R) -> R {
    loop {
        task.refresh().await;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.cancelled() => return task,
        }
    }
}
