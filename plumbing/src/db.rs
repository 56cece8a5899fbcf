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

/// A pool whose every wait is bounded: connecting, acquiring, and (through `statement_timeout`) queries.
pub async fn connect(url: &str, max_connections: u32, app_name: &str) -> Result<PgPool, DbError> {
    let options = PgConnectOptions::from_str(url)
        .map_err(DbError::InvalidUrl)?
        .application_name(app_name)
        .options([("statement_timeout", "30s"), ("lock_timeout", "10s")])
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(2));
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
    let start = tokio::time::Instant::now();
    let mut attempt = 0u32;
    loop {
        let result = async {
            let pool = connect(url, max_connections, app_name).await?;
            migrate(&pool, schema).await?;
            Ok::<_, DbError>(pool)
        }
        .await;
        match result {
            Ok(pool) => return Ok(pool),
            Err(e @ DbError::InvalidUrl(_)) => return Err(e),
            Err(e) if start.elapsed() >= deadline => return Err(e),
            Err(e) => {
                attempt += 1;
                let delay = crate::backoff::delay(
                    attempt,
                    Duration::from_millis(200),
                    Duration::from_secs(5),
                );
                tracing::warn!(error = %crate::telemetry::ErrorChain(&e), ?delay, "PostgreSQL not ready, retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}
