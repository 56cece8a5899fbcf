//! Wake-ups on PostgreSQL NOTIFY: LISTEN on a channel and wake a loop at every notification,
//! reconnecting with [`crate::backoff`] until stopped. The relay (channel `<schema>.messages`)
//! and the process worker (`<schema>.processes`) both wake this way.
//!
//! A notification is only a hint: one lost while the LISTEN connection was down is covered by the
//! wake-up after every (re)connect and by the caller's fallback poll.

use crate::error::ErrorChain;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The first wait after a failed LISTEN connection; it doubles per failure in a row.
const BACKOFF_BASE: Duration = Duration::from_millis(200);
/// The longest wait between two LISTEN connection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Where the LISTEN connection comes from.
#[derive(Debug, Clone)]
pub enum ListenOn {
    /// A connection of this pool.
    Pool(PgPool),
    /// A pool of one connection to this (direct, session-holding) URL, made again at every
    /// attempt: for a pool that goes through a transaction pooler, where LISTEN does not hold.
    Direct {
        /// The direct URL.
        url: String,
        /// The connection's `application_name`.
        app_name: String,
    },
}

impl ListenOn {
    /// A pool of its own (one connection, lazily made, with `pool`'s connect options): sqlx hands
    /// a dropped listener's connection back from a spawned task, which must never hold up
    /// closing the caller's pool.
    pub fn own_pool(pool: &PgPool) -> Self {
        Self::Pool(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy_with(pool.connect_options().as_ref().clone()),
        )
    }

    /// Where to LISTEN for a component whose `pool` connects to `target`: a pool of its own on the
    /// same settings when `target` is a direct session, the direct URL (as `app_name`) when the
    /// pool goes through a transaction pooler, and nowhere (`None`: the caller's poll alone finds
    /// the work) when there is no direct URL to go to.
    pub fn for_target(
        target: crate::db::Target<'_>,
        pool: &PgPool,
        app_name: &str,
    ) -> Option<Self> {
        match target.session_url()? {
            url if url == target.url => Some(Self::own_pool(pool)),
            direct => Some(Self::Direct {
                url: direct.to_string(),
                app_name: app_name.to_string(),
            }),
        }
    }

    async fn pool(&self) -> Result<PgPool, crate::db::DbError> {
        match self {
            Self::Pool(pool) => Ok(pool.clone()),
            Self::Direct { url, app_name } => crate::db::connect(url, 1, app_name).await,
        }
    }
}

/// Wakes `wake` at every notification on `channel`, and once after every (re)connect (anything
/// committed while nobody listened is found by that wake-up), until `stop`. A failed connection
/// is logged and retried after an exponential backoff with jitter (200 ms doubling to 5 s).
pub async fn wake_on_notify(
    on: ListenOn,
    channel: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        // Set once LISTEN succeeded: a connection that worked and later failed starts the backoff
        // from the beginning instead of where the last outage left it.
        let mut listened = false;
        let result = async {
            let pool = on.pool().await?;
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener.listen(&channel).await?;
            listened = true;
            wake.notify_one();
            loop {
                // A notification, or Ok(None) after a reconnect that may have dropped some:
                // either way, look.
                listener.try_recv().await?;
                wake.notify_one();
            }
            #[allow(unreachable_code)]
            Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
        };
        tokio::select! {
            r = result => {
                if let Err(e) = r {
                    failures = if listened { 1 } else { failures + 1 };
                    tracing::warn!(error = %ErrorChain(&*e), "LISTEN connection failed; the poll covers until it is back");
                }
            }
            _ = stop.cancelled() => return,
        }
        let delay = crate::backoff::delay(failures.max(1), BACKOFF_BASE, BACKOFF_MAX);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.cancelled() => return,
        }
    }
}
