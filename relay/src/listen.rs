//! Wake-ups: LISTEN on the schema's channel (the outbox's statement trigger notifies at commit),
//! through [`plumbing::listen`]. What is the relay's own: where a session to LISTEN on is, when
//! `DATABASE_URL` may go through a transaction pooler. A notification is only a hint: the
//! pipeline's fallback poll covers what is lost.

use plumbing::listen::ListenOn;
use sqlx::PgPool;
use std::sync::Arc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// LISTENs for the outbox's NOTIFY on `channel` and wakes the publisher, until `stop`.
/// `session`: `None` when there is no session to LISTEN on (a transaction pooler and no direct
/// URL: the poll alone finds the rows), `Some(None)` to LISTEN on a connection of `pool`,
/// `Some(Some(url))` on a direct connection.
pub(crate) async fn listen_loop(
    pool: PgPool,
    session: Option<Option<String>>,
    channel: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let on = match session {
        None => {
            tracing::info!(
                "no LISTEN: DATABASE_URL goes through a transaction pooler and DATABASE_DIRECT_URL is unset; the poll finds new rows"
            );
            return;
        }
        Some(None) => ListenOn::Pool(pool),
        Some(Some(url)) => ListenOn::Direct {
            url,
            app_name: "outbox-relay-listen".into(),
        },
    };
    plumbing::listen::wake_on_notify(on, channel, wake, stop).await;
}
