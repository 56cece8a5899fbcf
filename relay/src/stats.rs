//! The backlog gauges (pending, oldest age, dead) and the unrouted-queue depth, refreshed on a
//! timer of their own so the publish loop never waits on them.

use crate::{internal_events, publisher, store};
use plumbing::amqp_tls::AmqpTls;
use plumbing::telemetry::ErrorChain;
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

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
        match plumbing::db::bounded(store::backlog(&pool, &schema)).await {
            Ok(b) => internal_events::backlog(b.pending, b.oldest_age, b.dead),
            Err(e) => tracing::debug!(error = %ErrorChain(&e), "backlog query failed"),
        }
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
            _ = tokio::time::sleep(every) => {}
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
