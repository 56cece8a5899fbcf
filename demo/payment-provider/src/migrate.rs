//! The simulator's migrations: its tables live in the schema `provider`, with their own history
//! table `provider._migrations` (never the service's `_sqlx_migrations`, never the product's).

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{PgPool, SqlSafeStr};

/// The simulator's own schema.
pub const PROVIDER_SCHEMA: &str = "provider";

const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "provider",
        include_str!("../migrations/0001_provider.sql"),
    ),
    (
        2,
        "async confirmation",
        include_str!("../migrations/0002_async_confirmation.sql"),
    ),
    (
        3,
        "notifications",
        include_str!("../migrations/0003_notifications.sql"),
    ),
];

/// The simulator's migrator.
pub fn migrator() -> Migrator {
    shared::migrate::schema_migrator(PROVIDER_SCHEMA, MIGRATIONS, SqlSafeStr::into_sql_str)
}

/// Applies the pending migrations (sqlx holds an advisory lock meanwhile).
pub async fn run(pool: &PgPool) -> Result<(), MigrateError> {
    migrator().run(pool).await
}
