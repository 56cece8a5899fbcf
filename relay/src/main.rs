//! `relay`: publishes committed outbox rows to RabbitMQ. See `relay --help`.

use anyhow::Context;
use clap::{Parser, Subcommand};
use relay::RelayConfig;
use uuid::Uuid;

/// Publishes committed outbox rows to RabbitMQ at least once, in order per aggregate.
#[derive(Debug, Parser)]
#[command(name = "relay", version, about)]
struct Cli {
    #[command(flatten)]
    config: RelayConfig,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish outbox rows until SIGTERM/SIGINT (the default).
    Run,
    /// Apply the database migrations and exit.
    Migrate,
    /// Inspect and requeue dead rows (rows that exhausted their attempts).
    Dead {
        #[command(subcommand)]
        command: DeadCommand,
    },
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// List dead rows with their last error.
    List {
        /// Show at most this many rows.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Put dead rows back to pending with fresh attempts.
    Requeue {
        /// Message ids (outbox.id) to requeue.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        ids: Vec<Uuid>,
        /// Requeue every dead row.
        #[arg(long)]
        all: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    plumbing::telemetry::init(
        &std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "relay".into()),
        cli.config.connections.otlp_endpoint.as_deref(),
    );
    let schema = cli.config.connections.schema.clone();
    match cli.command.unwrap_or(Command::Run) {
        Command::Run => {
            let shutdown = plumbing::shutdown::on_signal();
            let result = relay::run(cli.config, shutdown).await;
            plumbing::telemetry::shutdown_tracing();
            result?;
        }
        Command::Migrate => {
            let db = cli.config.connections.database();
            let url = db.session_url().context(
                "migrations take a session advisory lock, which does not hold through a transaction pooler: set DATABASE_DIRECT_URL",
            )?;
            let pool = plumbing::db::connect(url, 1, "relay-migrate").await?;
            plumbing::db::migrate(&pool, &schema).await?;
            println!("migrations applied in schema {schema}");
        }
        Command::Dead { command } => {
            let pool = plumbing::db::connect_and_migrate_to(
                cli.config.connections.database(),
                1,
                "relay-dead",
                &schema,
                std::time::Duration::ZERO,
            )
            .await
            .context("connecting to PostgreSQL")?;
            match command {
                DeadCommand::List { limit } => {
                    relay::dead::list(&pool, &schema, limit, &mut std::io::stdout()).await?;
                }
                DeadCommand::Requeue { ids, all } => {
                    relay::dead::requeue(
                        &pool,
                        &schema,
                        if all { None } else { Some(&ids) },
                        &mut std::io::stdout(),
                    )
                    .await?;
                }
            }
        }
    }
    Ok(())
}
