//! The product's migrations: applied in its own schema, recorded in its own history table.
//!
//! The SQL lives in `migrations/` at the workspace root with a `{{schema}}` placeholder; this
//! module renders it for the configured [`Schema`] and runs it with sqlx's migrator, whose history
//! table is `<schema>._migrations`, never the service's `public._sqlx_migrations`. sqlx holds a
//! database-wide advisory lock while migrating, so binaries that start together (and a service
//! running its own sqlx migrations at the same moment) wait for each other instead of racing.
//!
//! A service that embeds the relay or the consumer runs [`run`] from its own start-up code, next
//! to its own migrations.

use crate::schema::Schema;
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{PgPool, SqlSafeStr, SqlStr};
use std::borrow::Cow;

/// (version, description, SQL template), in order.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "messages",
        include_str!("../../migrations/0001_messages.sql"),
    ),
    (
        2,
        "processed_messages",
        include_str!("../../migrations/0002_processed_messages.sql"),
    ),
    (
        3,
        "idempotency_keys",
        include_str!("../../migrations/0003_idempotency_keys.sql"),
    ),
    (
        4,
        "adopt_legacy_tables",
        include_str!("../../migrations/0004_adopt_legacy_tables.sql"),
    ),
    (
        5,
        "processes",
        include_str!("../../migrations/0005_processes.sql"),
    ),
    (
        6,
        "console",
        include_str!("../../migrations/0006_console.sql"),
    ),
    (
        7,
        "idempotency key comments",
        include_str!("../../migrations/0007_idempotency_key_comments.sql"),
    ),
    (
        8,
        "aggregate sequences",
        include_str!("../../migrations/0008_aggregate_sequences.sql"),
    ),
    (
        9,
        "webhook inbox",
        include_str!("../../migrations/0009_webhook_inbox.sql"),
    ),
    (
        10,
        "console approvals: resolve_failed, one pending per target, superseded",
        include_str!("../../migrations/0010_console_approvals.sql"),
    ),
    (
        11,
        "process waits",
        include_str!("../../migrations/0011_process_waits.sql"),
    ),
    (
        12,
        "ordered consumers",
        include_str!("../../migrations/0012_ordered_consumers.sql"),
    ),
    (
        13,
        "console actions on ordered consumers",
        include_str!("../../migrations/0013_console_ordered_actions.sql"),
    ),
    (
        14,
        "aggregate numbers: one cache per schema, no number for a repeated id, one flush per transaction",
        include_str!("../../migrations/0014_aggregate_seq_fixes.sql"),
    ),
    (
        15,
        "cheaper inserts: header checks in PL/pgSQL, a flush queued only when behind, one upsert",
        include_str!("../../migrations/0015_cheaper_inserts.sql"),
    ),
    (
        16,
        "console look: compensation labels, processes by business key, console samples",
        include_str!("../../migrations/0016_console_look.sql"),
    ),
    (
        17,
        "console find: indexed search keys and keyset pages of processes",
        include_str!("../../migrations/0017_console_find.sql"),
    ),
    (
        18,
        "robust plans: the claim's partition index and the insert trigger's id lookup whatever the statistics",
        include_str!("../../migrations/0018_robust_plans.sql"),
    ),
    (
        19,
        "counter flush by the primary key whatever the call's collation; the per-row flush check without a SET clause",
        include_str!("../../migrations/0019_counter_flush_by_index.sql"),
    ),
    (
        20,
        "cheaper many-row inserts: empty headers checked at once, one statement per numbered row",
        include_str!("../../migrations/0020_cheaper_batch_inserts.sql"),
    ),
    (
        21,
        "dependencies: shared circuits and limits; process steps that wait for an unavailable remote",
        include_str!("../../migrations/0021_dependencies.sql"),
    ),
    (
        22,
        "weighted fair share: a process's fair key and the index of the fair claim",
        include_str!("../../migrations/0022_fair_share.sql"),
    ),
    (
        23,
        "claim positions: the relay reads each partition past the position it has passed; late commits found by their transaction",
        include_str!("../../migrations/0023_claim_positions.sql"),
    ),
    (
        24,
        "money: the input amounts a process definition declares money, resolved at start",
        include_str!("../../migrations/0024_process_money.sql"),
    ),
    (
        25,
        "console sessions: when each was last used, for the idle timeout",
        include_str!("../../migrations/0025_console_session_idle.sql"),
    ),
    (
        26,
        "aggregate counters: at most 32 updates per row, no unbounded version chains under an old snapshot",
        include_str!("../../migrations/0026_bounded_counter_rows.sql"),
    ),
];

/// Name of the history table inside the schema.
pub const HISTORY_TABLE: &str = "_migrations";

/// The product's migrator for `schema`.
pub fn migrator(schema: &Schema) -> Migrator {
    schema_migrator(schema.quoted(), MIGRATIONS, |template| {
        schema.sql(template).into_sql_str()
    })
}

/// A migrator of simple migrations, (version, description, SQL as `sql` renders it), that
/// creates `schema` (an SQL name, quoted where it needs to be) and records its history in
/// `<schema>._migrations`: the product's, and an application's tables in a schema of their own.
pub fn schema_migrator(
    schema: &str,
    migrations: &'static [(i64, &'static str, &'static str)],
    sql: impl Fn(&'static str) -> SqlStr,
) -> Migrator {
    let migrations = migrations
        .iter()
        .map(|(version, description, text)| {
            Migration::new(
                *version,
                Cow::Borrowed(*description),
                MigrationType::Simple,
                sql(text),
                false,
            )
        })
        .collect();
    let mut m = Migrator::with_migrations(migrations);
    m.create_schema(schema.to_string());
    m.dangerous_set_table_name(format!("{schema}.{HISTORY_TABLE}"));
    m
}

/// The SQL of migration `version` as rendered for `schema` (tools and benchmarks that rebuild an
/// earlier layout piece by piece); `None` for a version the product does not have.
pub fn sql_of(schema: &Schema, version: i64) -> Option<String> {
    MIGRATIONS
        .iter()
        .find(|(v, _, _)| *v == version)
        .map(|(_, _, template)| schema.render(template))
}

/// Applies the product's pending migrations in `schema`.
pub async fn run(pool: &PgPool, schema: &Schema) -> Result<(), MigrateError> {
    migrator(schema).run(pool).await
}

/// Applies the pending migrations up to and including `version`: an installation as an earlier
/// release left it, for the tests of an upgrade.
pub async fn run_to(pool: &PgPool, schema: &Schema, version: i64) -> Result<(), MigrateError> {
    migrator(schema).run_to(version, pool).await
}
