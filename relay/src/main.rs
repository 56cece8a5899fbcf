//! `relay`: publishes committed outbox rows to RabbitMQ. See `relay --help`.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use relay::RelayConfig;
use shared::schema::Schema;
use std::io::Write;
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
    /// Reconcile the messages published in a time window against a consumer's processed messages:
    /// missing ids, end-to-end lag. Needs published rows kept (`--retention-secs`). Exits 2 when
    /// something is missing.
    Verify(VerifyArgs),
    /// Inspect and requeue dead rows (rows that exhausted their attempts).
    Dead {
        #[command(subcommand)]
        command: DeadCommand,
    },
}

/// What `relay verify` reconciles, and how it prints the report.
#[derive(Debug, Args)]
struct VerifyArgs {
    /// The consumer's name (as in `processed_messages`).
    #[arg(long)]
    consumer: String,
    /// Start of the window on created_at: an RFC 3339 time or a duration before now (`2h`).
    #[arg(long, default_value = "1h")]
    since: String,
    /// End of the window: an RFC 3339 time or a duration before now (default: now).
    #[arg(long)]
    until: Option<String>,
    /// Only these event types (repeat the flag); default: all.
    #[arg(long = "event-type")]
    event_types: Vec<String>,
    /// Rows published this recently are in flight, not missing (e.g. `30s`).
    #[arg(long, default_value = "30s")]
    settle: String,
    /// Most missing ids listed.
    #[arg(long, default_value_t = 100)]
    limit: i64,
    /// Output: human, json, or prometheus (text format for node_exporter's textfile collector).
    #[arg(long, default_value = "human", value_parser = ["human", "json", "prometheus"])]
    format: String,
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
    plumbing::telemetry::init_service("relay", cli.config.connections.otlp_endpoint.as_deref());
    let schema = cli.config.connections.schema.clone();
    match cli.command.unwrap_or(Command::Run) {
        Command::Run => {
            plumbing::telemetry::run_until_signal(|shutdown| relay::run(cli.config, shutdown))
                .await?;
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
        Command::Verify(args) => verify(&cli.config, &schema, args).await?,
        Command::Dead { command } => dead(&cli.config, &schema, command).await?,
    }
    Ok(())
}

/// `relay verify`: reconciles and prints; exits 2 when something is missing.
async fn verify(config: &RelayConfig, schema: &Schema, args: VerifyArgs) -> anyhow::Result<()> {
    let now = chrono::Utc::now();
    let req = relay::verify::VerifyRequest {
        consumer: args.consumer,
        since: relay::verify::parse_time(&args.since, now)?,
        until: args
            .until
            .map(|u| relay::verify::parse_time(&u, now))
            .transpose()?
            .unwrap_or(now),
        event_types: args.event_types,
        settle: relay::verify::parse_duration(&args.settle)?,
        list_limit: args.limit.max(0),
    };
    let pool = plumbing::db::connect(&config.connections.database_url, 1, "relay-verify")
        .await
        .context("connecting to PostgreSQL")?;
    let report = relay::verify::verify(&pool, schema, &req)
        .await
        .context("reconciling")?;
    let mut out = std::io::stdout().lock();
    match args.format.as_str() {
        "json" => {
            serde_json::to_writer_pretty(&mut out, &report)?;
            writeln!(out)?;
        }
        "prometheus" => relay::verify::write_prometheus(&report, &mut out)?,
        _ => relay::verify::write_human(&report, &mut out)?,
    }
    out.flush()?;
    if !report.ok() {
        std::process::exit(2);
    }
    Ok(())
}

/// `relay dead list|requeue`.
async fn dead(config: &RelayConfig, schema: &Schema, command: DeadCommand) -> anyhow::Result<()> {
    let pool = plumbing::db::connect_and_migrate_to(
        config.connections.database(),
        1,
        "relay-dead",
        schema,
        std::time::Duration::ZERO,
    )
    .await
    .context("connecting to PostgreSQL")?;
    match command {
        DeadCommand::List { limit } => {
            relay::dead::list(&pool, schema, limit, &mut std::io::stdout()).await?;
        }
        DeadCommand::Requeue { ids, all } => {
            relay::dead::requeue(
                &pool,
                schema,
                if all { None } else { Some(&ids) },
                &mut std::io::stdout(),
            )
            .await?;
        }
    }
    Ok(())
}
