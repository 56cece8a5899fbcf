//! The backlog gauges (pending, oldest age, dead) and the unrouted-queue depth, refreshed on a
//! timer of their own so the publish loop never waits on them.
//!
//! Counting the pending rows reads every one of them: 0.6 s for a backlog of 50,000 rows (the
//! first count after a bulk load also sets their hint bits). Every 5 s, that was a tenth of a
//! core taken from the database exactly while the relay drains a backlog. So the refresh waits
//! [`COST_FACTOR`] times as long as the last count took when that is longer than the interval:
//! the gauges cost at most a twentieth of one database core, and a large backlog's gauge is
//! refreshed less often (a 1,000,000-row backlog about every 2 minutes instead of every 5 s).

use crate::{internal_events, publisher, store};
use plumbing::amqp_tls::AmqpTls;
use plumbing::telemetry::ErrorChain;
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The backlog count may use at most 1 / `COST_FACTOR` of the time between two counts.
const COST_FACTOR: u32 = 20;

/// The wait before the next refresh: the interval, or longer after a count that took long.
fn next_wait(every: Duration, count_took: Duration) -> Duration {
    every.max(count_took * COST_FACTOR)
}

/// Refreshes the backlog gauges, and the unrouted-queue depth over a connection of its own, so
/// the publish loop never waits on these.
pub(crate) async fn stats_loop(
    pool: PgPool,
    schema: Schema,
    amqp: Option<(String, AmqpTls, String)>,
    every: Duration,
    stop: CancellationToken,
) {
    let mut conn: Option<lapin::Connection> = None;
    loop {
        let started = tokio::time::Instant::now();
        match plumbing::db::bounded(store::backlog(&pool, &schema)).await {
            Ok(b) => internal_events::backlog(b.pending, b.oldest_age, b.dead),
            Err(e) => tracing::debug!(error = %ErrorChain(&e), "backlog query failed"),
        }
        let wait = next_wait(every, started.elapsed());
        if let Some((url, tls, exchange)) = &amqp {
            if !conn.as_ref().is_some_and(|c| c.status().connected()) {
                conn = plumbing::amqp_nodes::connect(url, tls, "outbox-relay-stats")
                    .await
                    .ok();
            }
            if let Some(c) = &conn
                && let Some(depth) = publisher::unrouted_depth(c, exchange).await
            {
                internal_events::unrouted(depth);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => break,
        }
    }
    if let Some(c) = conn {
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            c.close(200, "relay stopping".into()),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_count_spaces_the_next_refresh_out_a_fast_one_keeps_the_interval() {
        let every = Duration::from_secs(5);
        assert_eq!(next_wait(every, Duration::from_millis(30)), every);
        assert_eq!(
            next_wait(every, Duration::from_millis(600)),
            Duration::from_secs(12)
        );
    }
}
