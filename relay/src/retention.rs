//! Retention of published rows: with `--retention-secs` set, confirmed rows are kept as
//! `published` (for audits and `relay verify`) and purged in bounded batches once older.

use crate::store;
use plumbing::telemetry::ErrorChain;
use shared::schema::Schema;
use sqlx::PgPool;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Purges published rows older than `retention` every 10 s (or `retention`, if shorter), until `stop`.
pub(crate) async fn retention_loop(
    pool: PgPool,
    schema: Schema,
    retention: Duration,
    stop: CancellationToken,
) {
    const BATCH: i64 = 5000;
    loop {
        let mut after = None;
        loop {
            match plumbing::db::bounded(store::purge_published(
                &pool, &schema, retention, BATCH, after,
            ))
            .await
            {
                Ok((n, last)) if n as i64 >= BATCH && !stop.is_cancelled() => after = last,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %ErrorChain(&e), "purging published rows failed");
                    break;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(10).min(retention)) => {}
            _ = stop.cancelled() => return,
        }
    }
}
