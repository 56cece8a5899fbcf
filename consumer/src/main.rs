//! `consumer`: manages a consumer's dead letters. Consuming is done by the library, embedded in a
//! service with its handlers (see `producer ledger` for the example application's).

use anyhow::Context;
use clap::{Parser, Subcommand};
use consumer::dlq;
use shared::display::escape_control;

/// Manages the dead letters of a consumer built with the `consumer` library.
#[derive(Debug, Parser)]
#[command(name = "consumer", version)]
struct Cli {
    #[command(flatten)]
    settings: consumer::config::Settings,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Dead letters of this consumer (`NAME.dlq`).
    Dlq {
        #[command(subcommand)]
        action: DlqCommand,
    },
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// Show dead letters with their reasons, oldest first; they stay in the queue.
    List {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Show at most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Re-inject dead letters into the consumer's queue with their original message ids
    /// (deduplication still holds) and a fresh attempt budget.
    Replay {
        /// Message ids to replay.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        ids: Vec<String>,
        /// Replay every dead letter.
        #[arg(long)]
        all: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    plumbing::telemetry::init_service(
        "consumer",
        cli.settings.connections.otlp_endpoint.as_deref(),
    );
    let config = cli.settings.into_config().context("invalid settings")?;
    match cli.command {
        Some(Command::Dlq {
            action: DlqCommand::List { json, limit },
        }) => {
            let letters =
                dlq::list(&config.amqp_url, &config.amqp_tls, &config.name, limit).await?;
            print_list(&letters, json)?;
        }
        Some(Command::Dlq {
            action: DlqCommand::Replay { ids, all },
        }) => {
            let selection = if all {
                dlq::Selection::All
            } else {
                dlq::Selection::Ids(ids)
            };
            let report =
                dlq::replay(&config.amqp_url, &config.amqp_tls, &config.name, &selection).await?;
            println!("replayed {} dead letter(s)", report.replayed.len());
            for id in &report.replayed {
                println!("  {id}");
            }
            if !report.not_found.is_empty() {
                anyhow::bail!(
                    "not in the dead-letter queue: {}",
                    report.not_found.join(", ")
                );
            }
        }
        None => anyhow::bail!(
            "the consumer binary manages dead letters (`consumer dlq list|replay`); to consume, embed \
             consumer::run with your handlers in your service (the example application runs one: \
             `producer ledger`)"
        ),
    }
    Ok(())
}

fn print_list(letters: &[dlq::DeadLetter], json: bool) -> anyhow::Result<()> {
    if json {
        for l in letters {
            println!("{}", serde_json::to_string(l)?);
        }
        return Ok(());
    }
    println!(
        "{:<36}  {:<24}  {:<18}  {:>8}  {:<32}  REASON",
        "MESSAGE ID", "EVENT TYPE", "KIND", "ATTEMPTS", "DEAD-LETTERED AT"
    );
    // Every value came from a delivery: escaped, so that none can forge lines or columns.
    let e = escape_control;
    for l in letters {
        println!(
            "{:<36}  {:<24}  {:<18}  {:>8}  {:<32}  {}",
            e(l.message_id.as_deref().unwrap_or("-")),
            e(&l.event_type),
            e(&l.kind),
            l.attempts.map_or("-".to_string(), |a| a.to_string()),
            e(l.dead_lettered_at.as_deref().unwrap_or("-")),
            e(&l.reason)
        );
    }
    println!("{} dead letter(s)", letters.len());
    Ok(())
}
