//! Wake-ups: LISTEN on the schema's channel (the outbox's statement trigger notifies at commit).
//! A notification is only a hint: one lost while the LISTEN connection was down is covered by
//! the wake-up after every reconnect and by the pipeline's fallback poll.

use plumbing::telemetry::ErrorChain;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Wakes the pipeline on every notification on `channel`, reconnecting with backoff, until `stop`.
pub(crate) async fn listen_loop(
    pool: PgPool,
    channel: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        let result = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener.listen(&channel).await?;
            // Anything committed while we were not listening is found by this wake-up.
            wake.notify_one();
            loop {
                // A notification, or Ok(None) after a reconnect that may have dropped some:
                // either way, look at the outbox.
                listener.try_recv().await?;
                wake.notify_one();
            }
            #[allow(unreachable_code)]
            Ok::<(), sqlx::Error>(())
        };
        tokio::select! {
            r = result => {
                if let Err(e) = r {
                    failures += 1;
                    tracing::warn!(error = %ErrorChain(&e), "LISTEN connection failed; the poll covers until it is back");
                }
            }
            _ = stop.cancelled() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(plumbing::backoff::delay(failures.max(1), Duration::from_millis(200), Duration::from_secs(5))) => {}
            _ = stop.cancelled() => return,
        }
    }
}
