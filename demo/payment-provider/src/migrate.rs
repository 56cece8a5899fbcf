//! The simulator's migrations: its tables live in the schema `provider`, with their own history
//! table `provider._migrations` (never the service's `_sqlx_migrations`, never the product's).

use sqlx::PgPool;
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use std::borrow::Cow;

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
];

/// The simulator's migrator.
pub fn migrator() -> Migrator {
    let migrations = MIGRATIONS
        .iter()
        .map(|(version, description, sql)| {
            Migration::new(
                *version,
                Cow::Borrowed(*description),
                MigrationType::Simple,
                sqlx::SqlSafeStr::into_sql_str(*sql),
                false,
            )
        })
        .collect();
    let mut m = Migrator::with_migrations(migrations);
    m.create_schema(PROVIDER_SCHEMA);
    m.dangerous_set_table_name(format!("{PROVIDER_SCHEMA}._migrations"));
    m
}

/// Applies the pending migrations (sqlx holds an advisory lock meanwhile).
pub async fn run(pool: &PgPool) -> Result<(), MigrateError> {
    migrator().run(pool).await
}
