//! The backlog gauges (pending, oldest age, dead), what holds back cleanup (the oldest snapshot,
//! the dead tuples of the product's tables) and the unrouted-queue depth, refreshed on a
//! timer of their own ([`plumbing::periodic`]) so the publish loop never waits on them.
//!
//! Counting the pending rows reads every one of them: 0.6 s for a backlog of 50,000 rows (the
//! first count after a bulk load also sets their hint bits). Every 5 s, that was a tenth of a
//! core taken from the database exactly while the relay drains a backlog; the periodic loop
//! spaces refreshes that take long out, so a large backlog's gauge is refreshed less often (a
//! 1,000,000-row backlog every minute, the cap, instead of every 5 s).

use crate::{internal_events, publisher, store};
use plumbing::amqp_tls::AmqpTls;
use plumbing::telemetry::ErrorChain;
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Refreshes the backlog gauges, and the unrouted-queue depth over a connection of its own, so
/// the publish loop never waits on these; that connection is closed at `stop`.
pub(crate) async fn stats_loop(
    pool: PgPool,
    schema: Schema,
    amqp: Option<(String, AmqpTls, String)>,
    every: Duration,
    stop: CancellationToken,
) {
    let gauges = Gauges {
        pool,
        schema,
        amqp,
        conn: None,
    };
    let gauges = plumbing::periodic::every(every, &stop, gauges).await;
    if let Some(c) = gauges.conn {
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            c.close(200, "relay stopping".into()),
        )
        .await;
    }
}

/// What one refresh reads, and the AMQP connection kept between refreshes.
struct Gauges {
    pool: PgPool,
    schema: Schema,
    /// URL, TLS and exchange, when the exchange has an unrouted queue to measure.
    amqp: Option<(String, AmqpTls, String)>,
    conn: Option<lapin::Connection>,
}

impl plumbing::periodic::Refresh for Gauges {
    async fn refresh(&mut self) {
        match plumbing::db::bounded(store::backlog(&self.pool, &self.schema)).await {
            Ok(b) => internal_events::backlog(b.pending, b.oldest_age, b.dead),
            Err(e) => tracing::debug!(error = %ErrorChain(&e), "backlog query failed"),
        }
        match plumbing::db::bounded(store::horizon(&self.pool, &self.schema)).await {
            Ok(h) => internal_events::horizon(&h),
            Err(e) => tracing::debug!(error = %ErrorChain(&e), "horizon query failed"),
        }
        if let Some((url, tls, exchange)) = &self.amqp {
            if !self.conn.as_ref().is_some_and(|c| c.status().connected()) {
                self.conn = plumbing::amqp_nodes::connect(url, tls, "outbox-relay-stats")
                    .await
                    .ok();
            }
            if let Some(c) = &self.conn
                && let Some(depth) = publisher::unrouted_depth(c, exchange).await
            {
                internal_events::unrouted(depth);
            }
        }
    }
}
