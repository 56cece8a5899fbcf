//! The example application's migrations: its tables live in the schema `demo`, with their own
//! history table `demo._migrations`, beside the product's schema (which they reference for the
//! idempotency records). [`run`] applies the product's migrations first, then these.

use shared::schema::Schema;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{PgPool, SqlSafeStr};

/// The example application's own schema.
pub const DEMO_SCHEMA: &str = "demo";

const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "demo", include_str!("../migrations/0001_demo.sql")),
    (
        2,
        "payment process",
        include_str!("../migrations/0002_payment_process.sql"),
    ),
    (
        3,
        "payment events",
        include_str!("../migrations/0003_payment_events.sql"),
    ),
    (
        4,
        "reconciliation",
        include_str!("../migrations/0004_reconciliation.sql"),
    ),
    (
        5,
        "timeline",
        include_str!("../migrations/0005_timeline.sql"),
    ),
];

/// The demo's migrator; `product` is the product schema its SQL refers to.
pub fn migrator(product: &Schema) -> Migrator {
    shared::migrate::schema_migrator(DEMO_SCHEMA, MIGRATIONS, |template| {
        product.sql(template).into_sql_str()
    })
}

/// Applies the product's migrations in `product`, then the demo's.
pub async fn run(pool: &PgPool, product: &Schema) -> Result<(), MigrateError> {
    shared::migrate::run(pool, product).await?;
    migrator(product).run(pool).await
}
