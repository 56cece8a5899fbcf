//! `payment-provider`: the example application's payment provider simulator.

use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "payment-provider",
    version,
    about = "Payment provider simulator: charges, refunds and injectable faults over HTTP"
)]
struct Cli {
    #[command(flatten)]
    config: payment_provider::Config,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    plumbing::telemetry::init_logging();
    plumbing::telemetry::run_until_signal(|shutdown| payment_provider::run(cli.config, shutdown))
        .await
        .context("payment provider failed")
}
