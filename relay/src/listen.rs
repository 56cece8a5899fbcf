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
/// LISTENs for the outbox's NOTIFY and wakes the publisher. `session`: `None` when there is no
/// session to LISTEN on (a transaction pooler and no direct URL: the poll alone finds the rows),
/// `Some(None)` to LISTEN on a connection of `pool`, `Some(Some(url))` on a direct connection.
pub(crate) async fn listen_loop(
    pool: PgPool,
    session: Option<Option<String>>,
    channel: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let Some(direct_url) = session else {
        tracing::info!(
            "no LISTEN: DATABASE_URL goes through a transaction pooler and DATABASE_DIRECT_URL is unset; the poll finds new rows"
        );
        return;
    };
    let mut failures = 0u32;
    loop {
        let result = async {
            let listen_pool = match &direct_url {
                Some(url) => plumbing::db::connect(url, 1, "outbox-relay-listen").await?,
                None => pool.clone(),
            };
            let mut listener = sqlx::postgres::PgListener::connect_with(&listen_pool).await?;
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
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        };
        tokio::select! {
            r = result => {
                if let Err(e) = r {
                    failures += 1;
                    tracing::warn!(error = %ErrorChain(&*e), "LISTEN connection failed; the poll covers until it is back");
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
