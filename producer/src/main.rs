//! `producer`: serve the HTTP API (default), or manage API keys.

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "producer",
    version,
    about = "Orders and payments API writing to the transactional outbox"
)]
struct Cli {
    #[command(flatten)]
    config: producer::Config,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the HTTP API (the default).
    Serve,
    /// Manage API keys.
    #[command(name = "api-key", subcommand)]
    ApiKey(ApiKeyCommand),
}

#[derive(Debug, Subcommand)]
enum ApiKeyCommand {
    /// Create a key for a tenant and print it, alone on its line, on stdout. It is shown only once.
    Create {
        /// Tenant name: 1-64 letters, digits, '.', '_' or '-'.
        #[arg(long)]
        tenant: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    shared::telemetry::init(
        &std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "producer".into()),
        cli.config.otlp_endpoint.as_deref(),
    );
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            let shutdown = shared::shutdown::on_signal();
            let result = producer::run(cli.config, shutdown).await;
            shared::telemetry::shutdown_tracing();
            result.context("producer failed")
        }
        Command::ApiKey(ApiKeyCommand::Create { tenant }) => {
            if !producer::auth::valid_tenant(&tenant) {
                anyhow::bail!(producer::auth::ApiKeyError::InvalidTenant);
            }
            let pool = shared::db::connect_and_migrate(
                &cli.config.database_url,
                2,
                "producer-api-key",
                Duration::from_secs(cli.config.db_connect_deadline_secs),
            )
            .await
            .context("cannot reach PostgreSQL")?;
            let key = producer::auth::create_api_key(&pool, &tenant)
                .await
                .context("cannot create the API key")?;
            pool.close().await;
            println!("{key}");
            Ok(())
        }
    }
}
