//! PostgreSQL connections, and the product's migrations at start-up.

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};
use std::str::FromStr;
use std::time::Duration;

use shared::schema::Schema;

/// Errors from connecting or migrating.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid DATABASE_URL")]
    InvalidUrl(#[source] sqlx::Error),
    #[error("cannot connect to PostgreSQL")]
    Connect(#[source] sqlx::Error),
    #[error("applying migrations failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
}

/// What a connection string goes through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Pooler {
    /// PostgreSQL itself (or a pooler in session mode): a connection is one session.
    #[default]
    None,
    /// PgBouncer in transaction pooling mode: a server connection is ours only for one
    /// transaction, so session state (LISTEN, session advisory locks, `SET`, startup `options`)
    /// does not hold.
    Transaction,
}

/// Where the database is: the URL for the pool, and a direct one for what needs a session.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub url: &'a str,
    /// A direct (not transaction-pooled) URL for LISTEN and migrations.
    pub direct_url: Option<&'a str>,
    pub pooler: Pooler,
}

impl<'a> Target<'a> {
    /// A direct connection string and nothing else.
    pub fn direct(url: &'a str) -> Self {
        Self {
            url,
            direct_url: None,
            pooler: Pooler::None,
        }
    }

    /// Where a session-bound connection (LISTEN, migrations) goes, if anywhere.
    pub fn session_url(&self) -> Option<&'a str> {
        match (self.direct_url, self.pooler) {
            (Some(direct), _) => Some(direct),
            (None, Pooler::None) => Some(self.url),
            (None, Pooler::Transaction) => None,
        }
    }
}

/// Session settings sent at connect (as the startup `options`): every statement and lock wait is
/// bounded on the server, and a session left idle inside a transaction (its client gone silent,
/// a black-holed link, a process frozen mid-batch) is ended after a minute, releasing its locks.
/// Without the last, such an orphaned transaction would hold, for instance, the deduplication
/// rows of a consumer's batch until TCP gave up (hours), and every redelivery of those messages
/// would wait for it. No transaction of ours is idle that long: handlers are bounded at 30 s.
pub const SESSION_SETTINGS: [(&str, &str); 3] = [
    ("statement_timeout", "30s"),
    ("lock_timeout", "10s"),
    ("idle_in_transaction_session_timeout", "60s"),
];

/// The longest a component waits for any statement of its own. PostgreSQL's `statement_timeout`
/// (30 s, [`SESSION_SETTINGS`]) ends a slow statement; this bound ends a wait on a link that
/// answers nothing at all (black-holed), where no server-side timeout can fire.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(35);

/// Runs a statement (or a few) under [`CLIENT_TIMEOUT`]; running out is an I/O error like a cut
/// link (so [`is_unavailable`]).
pub async fn bounded<T>(
    op: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    match tokio::time::timeout(CLIENT_TIMEOUT, op).await {
        Ok(result) => result,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer from PostgreSQL within {CLIENT_TIMEOUT:?}"),
        ))),
    }
}

/// A pool whose every wait is bounded: connecting, acquiring, and (through `statement_timeout`) queries.
pub async fn connect(url: &str, max_connections: u32, app_name: &str) -> Result<PgPool, DbError> {
    connect_via(url, Pooler::None, max_connections, app_name).await
}

/// [`connect`] through `pooler`. Through a transaction pooler no startup `options` are sent
/// (PgBouncer refuses unknown startup parameters; `statement_timeout` and `lock_timeout` are then
/// the role's or the database's settings, see docs/operations.md) and no `extra_float_digits`.
pub async fn connect_via(
    url: &str,
    pooler: Pooler,
    max_connections: u32,
    app_name: &str,
) -> Result<PgPool, DbError> {
    let mut options = PgConnectOptions::from_str(url)
        .map_err(DbError::InvalidUrl)?
        .application_name(app_name)
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(2));
    options = match pooler {
        Pooler::None => options.options(SESSION_SETTINGS),
        Pooler::Transaction => options.extra_float_digits(None),
    };
    PgPoolOptions::new()
        .max_connections(max_connections)
        .min_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(DbError::Connect)
}

/// Applies the product's pending migrations in `schema` (see [`shared::migrate`]). sqlx holds an
/// advisory lock while migrating, so instances that start together wait for each other.
pub async fn migrate(pool: &PgPool, schema: &Schema) -> Result<(), DbError> {
    shared::migrate::run(pool, schema)
        .await
        .map_err(DbError::Migrate)
}

/// Connects and migrates, retrying with backoff until `deadline` (PostgreSQL may still be starting).
pub async fn connect_and_migrate(
    url: &str,
    max_connections: u32,
    app_name: &str,
    schema: &Schema,
    deadline: Duration,
) -> Result<PgPool, DbError> {
    connect_and_migrate_to(
        Target::direct(url),
        max_connections,
        app_name,
        schema,
        deadline,
    )
    .await
}

/// [`connect_and_migrate`] for a [`Target`]: the migrations (and their session advisory lock) run
/// over the direct URL when there is one; through a transaction pooler without one they are not
/// run at all (a warning says so), since the lock would not hold.
pub async fn connect_and_migrate_to(
    target: Target<'_>,
    max_connections: u32,
    app_name: &str,
    schema: &Schema,
    deadline: Duration,
) -> Result<PgPool, DbError> {
    let schema = schema.clone();
    connect_and_migrate_with(target, max_connections, app_name, deadline, move |pool| {
        let schema = schema.clone();
        Box::pin(async move { shared::migrate::run(&pool, &schema).await })
    })
    .await
}

/// Migrations run at start, given a session connection's pool.
pub type MigrationFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<(), sqlx::migrate::MigrateError>> + Send>>;

/// [`connect_and_migrate_to`] with `migrate` instead of the product's migrations alone (an
/// application that embeds the product runs its own after them), on the same session rules.
pub async fn connect_and_migrate_with(
    target: Target<'_>,
    max_connections: u32,
    app_name: &str,
    deadline: Duration,
    migrate: impl Fn(PgPool) -> MigrationFuture,
) -> Result<PgPool, DbError> {
    let migrate = |pool: &PgPool| {
        let fut = migrate(pool.clone());
        async move { fut.await.map_err(DbError::Migrate) }
    };
    let start = tokio::time::Instant::now();
    let mut attempt = 0u32;
    if target.session_url().is_none() {
        tracing::warn!(
            "DATABASE_URL goes through a transaction pooler and DATABASE_DIRECT_URL is unset: not migrating at start (run `relay migrate` against the database directly)"
        );
    }
    loop {
        let result = async {
            let pool = connect_via(target.url, target.pooler, max_connections, app_name).await?;
            match target.session_url() {
                Some(url) if url == target.url => migrate(&pool).await?,
                Some(direct) => {
                    let session = connect(direct, 1, app_name).await?;
                    let migrated = migrate(&session).await;
                    session.close().await;
                    migrated?;
                }
                None => {}
            }
            Ok::<_, DbError>(pool)
        }
        .await;
        match result {
            Ok(pool) => return Ok(pool),
            Err(e @ DbError::InvalidUrl(_)) => return Err(e),
            // A migration history that disagrees with this binary, or a migration's own SQL
            // error, is not cured by waiting: say so at once instead of "not ready, retrying".
            Err(DbError::Migrate(m)) if !may_succeed_later(&m) => return Err(DbError::Migrate(m)),
            Err(e) if start.elapsed() >= deadline => return Err(e),
            Err(e) => {
                attempt += 1;
                let delay = crate::backoff::delay(
                    attempt,
                    Duration::from_millis(200),
                    Duration::from_secs(5),
                );
                tracing::warn!(error = %crate::error::ErrorChain(&e), ?delay, "PostgreSQL not ready, retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Whether `e` says PostgreSQL is unavailable rather than that the statement was wrong: the
/// connection failed or was lost (08, I/O, TLS, protocol, pool), the server is short of resources
/// or failing (53, 58), or it is shutting down or starting (57P). Retrying later may succeed.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08")
                || c.starts_with("53")
                || c.starts_with("58")
                || c.starts_with("57P")
        }),
        _ => false,
    }
}

/// Whether a failed migration run may succeed when retried: only when PostgreSQL was
/// unavailable ([`is_unavailable`]), never for a history that disagrees with the binary or a
/// migration's own SQL error.
fn may_succeed_later(e: &sqlx::migrate::MigrateError) -> bool {
    use sqlx::migrate::MigrateError;
    match e {
        MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _) => is_unavailable(e),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::migrate::MigrateError;

    #[test]
    fn a_mismatched_history_is_not_retried_but_a_lost_connection_is() {
        assert!(!may_succeed_later(&MigrateError::VersionMismatch(4)));
        assert!(!may_succeed_later(&MigrateError::VersionMissing(
            20240101000000
        )));
        assert!(!may_succeed_later(&MigrateError::Dirty(3)));
        assert!(may_succeed_later(&MigrateError::Execute(sqlx::Error::Io(
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused)
        ))));
        assert!(may_succeed_later(&MigrateError::Execute(
            sqlx::Error::PoolTimedOut
        )));
    }
}
