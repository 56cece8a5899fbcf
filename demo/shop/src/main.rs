//! `producer`: the example application. Serves the orders/payments HTTP API (default), runs its
//! ledger consumer, its timeline consumer and its payment worker, manages API keys, applies its
//! migrations.

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "producer",
    version,
    about = "Orders and payments API writing to the transactional outbox"
)]
struct Cli {
    #[command(flatten)]
    config: demo::Config,
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
    /// Run the example ledger consumer (`payment.captured` moves `demo.ledger_balances`) until
    /// SIGTERM/SIGINT.
    Ledger {
        #[command(flatten)]
        settings: Box<consumer::config::Settings>,
    },
    /// Run the example timeline consumer (every event bound is appended to `demo.timeline`, so the
    /// order it was applied in shows from outside) until SIGTERM/SIGINT.
    Timeline {
        #[command(flatten)]
        settings: Box<consumer::config::Settings>,
    },
    /// Run the example notifier (every `payment.captured` posts a notification to the
    /// notification service at PROVIDER_URL, through its shared circuit) until SIGTERM/SIGINT.
    Notifier {
        /// Base URL of the notification service (the provider simulator's POST /notifications).
        #[arg(long, env = "PROVIDER_URL", default_value = "http://127.0.0.1:8090")]
        provider_url: String,
        /// Limit of one notification call, e.g. `5s`.
        #[arg(long, env = "NOTIFY_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
        notify_timeout: std::time::Duration,
        #[command(flatten)]
        settings: Box<consumer::config::Settings>,
    },
    /// Run the payment processes that POST /payments starts (charges at the provider at
    /// PROVIDER_URL) until SIGTERM/SIGINT.
    Worker {
        #[command(flatten)]
        settings: Box<demo::worker::WorkerSettings>,
    },
    /// Apply the product's and the example application's migrations, then exit.
    Migrate,
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
    plumbing::telemetry::init_service("producer", cli.config.otlp_endpoint.as_deref());
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            plumbing::telemetry::run_until_signal(|shutdown| demo::run(cli.config, shutdown))
                .await
                .context("producer failed")
        }
        Command::ApiKey(ApiKeyCommand::Create { tenant }) => {
            if !demo::auth::valid_tenant(&tenant) {
                anyhow::bail!(demo::auth::ApiKeyError::InvalidTenant);
            }
            let pool = demo::connect_and_migrate(&cli.config, 2, "producer-api-key")
                .await
                .context("cannot reach PostgreSQL")?;
            let key = demo::auth::create_api_key(&pool, &tenant)
                .await
                .context("cannot create the API key")?;
            pool.close().await;
            println!("{key}");
            Ok(())
        }
        Command::Worker { settings } => plumbing::telemetry::run_until_signal(|shutdown| {
            demo::worker::run(cli.config, *settings, shutdown)
        })
        .await
        .context("payment worker failed"),
        Command::Migrate => {
            let pool = demo::connect_and_migrate(&cli.config, 1, "producer-migrate").await?;
            pool.close().await;
            println!(
                "migrations applied (schemas {} and demo)",
                cli.config.schema
            );
            Ok(())
        }
        Command::Ledger { settings } => {
            run_consumer(&cli.config, *settings, "ledger", |config| {
                demo::ledger::handlers_with(config.named_statements)
            })
            .await
        }
        Command::Notifier {
            provider_url,
            notify_timeout,
            settings,
        } => {
            let client = payment_provider::client::Client::new(&provider_url, notify_timeout)
                .context("building the notification client")?;
            let dependency =
                demo::notifier::dependency().context("declaring the notification service")?;
            run_consumer(&cli.config, *settings, "notifier", move |_| {
                demo::notifier::handlers(client, dependency)
            })
            .await
        }
        Command::Timeline { settings } => {
            run_consumer(&cli.config, *settings, "timeline", |config| {
                demo::timeline::handlers(config.name.clone())
            })
            .await
        }
    }
}

/// Runs one of the example consumers (`what`: ledger, timeline) with the handlers `handlers`
/// builds from its configuration, until SIGTERM/SIGINT.
async fn run_consumer(
    app: &demo::Config,
    settings: consumer::config::Settings,
    what: &str,
    handlers: impl FnOnce(&consumer::Config) -> consumer::Handlers,
) -> anyhow::Result<()> {
    plumbing::telemetry::run_until_signal(|shutdown| async move {
        // DATABASE_URL may go through a transaction pooler (DATABASE_POOLER, with
        // DATABASE_DIRECT_URL for the migrations): then the consumer and the handlers run unnamed
        // statements in per-batch transactions, which works there.
        let connections = settings.connections.clone();
        let config = settings.into_config().context("invalid settings")?;
        let app_name = format!("consumer {}", config.name);
        let connect = demo::connect_and_migrate_to(
            connections.database(),
            config.pool_size(),
            &app_name,
            &connections.schema,
            std::time::Duration::from_secs(app.db_connect_deadline_secs),
        );
        let pool = tokio::select! {
            pool = connect => pool.context("connecting to PostgreSQL")?,
            _ = shutdown.cancelled() => return Ok(()),
        };
        let handlers = handlers(&config);
        consumer::run(config, pool, handlers, shutdown)
            .await
            .with_context(|| format!("{what} consumer failed"))
    })
    .await
}
