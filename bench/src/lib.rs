//! Benchmarks against the local PostgreSQL and RabbitMQ, each scenario bounded in time.
//!
//! A short tour:
//! - [`report`]: one line per scenario (`scenario`, `value`, `unit`, `ceiling`, `ratio`, `target`, `met`), as a table or JSON.
//! - [`env`](mod@env): a fresh bench database and exchange per run, child processes of the release binaries.
//! - [`scenarios`]: the list of scenarios ([`Scenario`]) and the message helpers they share; one
//!   file per scenario:
//! - [`ceiling_scenario`]: the AMQP and PostgreSQL ceilings.
//! - [`relay_scenario`]: the relay draining a backlog (one and two relays).
//! - [`latency_scenario`]: relay-latency and end-to-end at 1,000 msg/s, with the broker's floors.
//! - [`consumer_scenario`]: the consumer against raw consume+ack.
//! - [`api_scenario`]: the example API with new and replayed Idempotency-Keys.
//! - [`table_scenario`]: soak memory and the claim rate on a ten-million-row table.
//! - [`webhook_scenario`], [`waiting_scenario`], [`reconciliation_scenario`]: webhook ingest,
//!   waiting processes, reconciliation runs.
//! - [`ordered_scenario`]: ordered consumers against the same consumer unordered.
//! - [`process_scenario`]: recoverable processes (3-step no-op) against the commit ceiling.
//! - [`outage_scenario`]: a remote that is down: calls made to it with and without its circuit,
//!   the recovery, and what the circuit costs on the happy path.
//! - [`skew_scenario`]: the relay over 1 to 10,000 aggregates and Zipf-skewed keys.
//! - [`producer_insert_scenario`]: the producer's insert cost of per-aggregate sequence numbers.
//! - [`wire_count`]: a proxy that counts PostgreSQL round trips on the wire.
//!
//! Ratios compare with ceilings measured in the same run, because absolute numbers drift on a shared machine.

pub mod api_scenario;
pub mod ceiling_scenario;
pub mod consumer_scenario;
pub mod env;
pub mod fair_scenario;
pub mod latency_scenario;
pub mod ordered_scenario;
pub mod outage_scenario;
pub mod process_scenario;
pub mod producer_insert_scenario;
pub mod reconciliation_scenario;
pub mod relay_scenario;
pub mod report;
pub mod scenarios;
pub mod skew_scenario;
pub mod snapshot_scenario;
pub mod table_scenario;
pub mod waiting_scenario;
pub mod webhook_scenario;
pub mod wire_count;

use clap::Parser;
use report::Line;
pub use scenarios::Scenario;

/// Measures the relay, the consumer and the API against the same run's PostgreSQL and RabbitMQ ceilings.
#[derive(Debug, Clone, Parser)]
#[command(name = "bench", version, about)]
pub struct Args {
    /// Scenarios to run (default: all, in this order).
    #[arg(value_enum)]
    pub scenarios: Vec<Scenario>,
    /// Print one JSON object per scenario line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Multiply every size and duration (0.01 is a smoke run).
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Admin database URL; the bench creates and drops its own database next to it.
    #[arg(
        long,
        env = "BENCH_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub database_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// Directory of the relay, consumer and producer binaries (default: next to this one).
    #[arg(long)]
    pub bin_dir: Option<std::path::PathBuf>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // In run order, whatever order they were named in: the ceilings come first.
    let selected: Vec<Scenario> = Scenario::all()
        .iter()
        .copied()
        .filter(|s| args.scenarios.is_empty() || args.scenarios.contains(s))
        .collect();
    let env = env::BenchEnv::new(&args).await?;
    let mut lines: Vec<Line> = Vec::new();
    let mut ceilings = scenarios::Ceilings::default();
    for scenario in selected {
        let name = scenario.name();
        eprintln!("== {name}");
        let result = scenario.run(&env, &mut ceilings).await;
        match result {
            Ok(new) => {
                for l in &new {
                    if args.json {
                        println!("{}", serde_json::to_string(l)?);
                    }
                }
                lines.extend(new);
            }
            Err(e) => {
                let l = Line::failed(&name, &format!("{e:#}"));
                if args.json {
                    println!("{}", serde_json::to_string(&l)?);
                }
                lines.push(l);
            }
        }
    }
    env.cleanup().await;
    if !args.json {
        report::print_table(&lines);
    }
    Ok(())
}
