//! `console`: the operations console server and its CLI. See `console --help`. This file only
//! parses and dispatches; the commands live in `console::cli`.

use clap::{Parser, Subcommand};
use console::cli::args::{
    ApiCommand, ApprovalCommand, AuditCommand, DeadCommand, DlqCommand, OrderedCommand,
    ProcessCommand, UserCommand,
};
use console::cli::{Client, print};
use console::config::{ClientConfig, ServeConfig};
use std::io::Write;

/// The operations console: web page and API with roles, four-eyes approval and an audit log.
#[derive(Debug, Parser)]
#[command(name = "console", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeConfig,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the web page and the API until SIGTERM/SIGINT (the default).
    Serve,
    /// Apply the database migrations and exit.
    Migrate,
    /// Manage users (against the database; for administrators).
    User {
        #[command(subcommand)]
        command: UserCommand,
    },
    /// The commands that are clients of the API.
    #[command(flatten)]
    Api(ApiCommand),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut out = std::io::stdout();
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            plumbing::telemetry::init("console", None);
            let shutdown = plumbing::shutdown::on_signal();
            console::run(cli.serve, shutdown).await?;
        }
        Command::Migrate => {
            let db = &cli.serve.db;
            let pool = plumbing::db::connect(&db.database_url, 1, "console-migrate").await?;
            plumbing::db::migrate(&pool, &db.schema).await?;
            println!("migrations applied in schema {}", db.schema);
        }
        Command::User { command } => console::cli::users::run(command, &mut out).await?,
        Command::Api(command) => through_api(command, &mut out).await?,
    }
    Ok(())
}

/// The commands that are clients of the API: one typed call each, its answer printed.
async fn through_api(command: ApiCommand, out: &mut impl Write) -> anyhow::Result<()> {
    match command {
        ApiCommand::Dead { client, command } => {
            let api = client_of(&client);
            match command {
                DeadCommand::List => print::print_dead(&api.dead_rows().await?, out)?,
                DeadCommand::Requeue(selection) => {
                    let (status, body) = api.requeue_dead(&selection).await?;
                    print::print_outcome(status, &body, out)?;
                }
            }
        }
        ApiCommand::Dlq { client, command } => {
            let api = client_of(&client);
            match command {
                DlqCommand::List { consumer } => {
                    print::print_dead_letters(&api.dead_letters(&consumer).await?, out)?
                }
                DlqCommand::Replay {
                    consumer,
                    selection,
                } => {
                    let (status, body) = api.replay(&consumer, &selection).await?;
                    print::print_outcome(status, &body, out)?;
                }
            }
        }
        ApiCommand::Approvals { client, command } => {
            let api = client_of(&client);
            let (id, approve, reason, version) = match command {
                ApprovalCommand::List { status } => {
                    print::print_approvals(&api.approvals(status.as_deref()).await?, out)?;
                    return Ok(());
                }
                ApprovalCommand::Approve {
                    id,
                    reason,
                    version,
                } => (id, true, reason, version),
                ApprovalCommand::Reject {
                    id,
                    reason,
                    version,
                } => (id, false, reason, version),
            };
            let (status, body) = api.decide(id, approve, &reason, version).await?;
            print::print_outcome(status, &body, out)?;
        }
        ApiCommand::Process { client, command } => {
            let api = client_of(&client);
            match command {
                ProcessCommand::List {
                    kind,
                    status,
                    older_than_seconds,
                } => {
                    let list = api
                        .processes(kind.as_deref(), status.as_deref(), older_than_seconds)
                        .await?;
                    print::print_processes(&list, out)?;
                }
                ProcessCommand::Show { id } => print::print_process(&api.process(id).await?, out)?,
                ProcessCommand::Act(act) => {
                    let (status, body) = api.process_act(&act).await?;
                    print::print_outcome(status, &body, out)?;
                }
            }
        }
        ApiCommand::Ordered { client, command } => {
            let api = client_of(&client);
            match command {
                OrderedCommand::Show { consumer } => {
                    print::print_ordered(&api.ordered(&consumer).await?, out)?
                }
                OrderedCommand::Act(act) => {
                    let (status, body) = api.ordered_act(&act).await?;
                    print::print_outcome(status, &body, out)?;
                }
            }
        }
        ApiCommand::Audit { client, command } => {
            let AuditCommand::Export { since } = command;
            // JSON lines escape control characters themselves: printed as received.
            out.write_all(
                client_of(&client)
                    .audit_export(since.as_deref())
                    .await?
                    .as_bytes(),
            )?;
        }
    }
    Ok(())
}

/// The API client of a command's `--url` and `--token`.
fn client_of(c: &ClientConfig) -> Client {
    Client::new(&c.url, &c.token)
}
