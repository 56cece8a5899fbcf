//! `bench`: how close the relay and the consumer get to the machine's own ceilings. See `bench --help`.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = bench::Args::parse();
    bench::run(args).await
}
