//! `console`: the operations console server and its CLI. See `console --help`.

use anyhow::Context;
use clap::{Parser, Subcommand};
use console::cli::client::{self, Client};
use console::config::{ClientConfig, DbConfig, ServeConfig};
use console::roles::Role;
use serde_json::json;
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
    /// Dead outbox rows (through the API).
    Dead {
        #[command(flatten)]
        client: ClientConfig,
        #[command(subcommand)]
        command: DeadCommand,
    },
    /// Consumer dead letters (through the API).
    Dlq {
        #[command(flatten)]
        client: ClientConfig,
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Ordered consumers' stuck aggregates (through the API).
    Ordered {
        #[command(flatten)]
        client: ClientConfig,
        #[command(subcommand)]
        command: OrderedCommand,
    },
    /// Approval requests (through the API).
    Approvals {
        #[command(flatten)]
        client: ClientConfig,
        #[command(subcommand)]
        command: ApprovalCommand,
    },
    /// Processes (through the API).
    Process {
        #[command(flatten)]
        client: ClientConfig,
        #[command(subcommand)]
        command: ProcessCommand,
    },
    /// The audit log (through the API).
    Audit {
        #[command(flatten)]
        client: ClientConfig,
        #[command(subcommand)]
        command: AuditCommand,
    },
}

#[derive(Debug, Subcommand)]
enum UserCommand {
    /// Create a user; prints its token once, as the last line.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        role: Role,
        /// Revoke an active user of that name first (demo set-ups that run again).
        #[arg(long)]
        replace: bool,
        #[command(flatten)]
        db: DbConfig,
    },
    /// Revoke a user: its token and sessions stop working.
    Revoke {
        #[arg(long)]
        name: String,
        #[command(flatten)]
        db: DbConfig,
    },
    /// List active users.
    List {
        #[command(flatten)]
        db: DbConfig,
    },
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// List dead rows with their versions.
    List,
    /// Requeue rows given as ID:VERSION (more than one creates an approval request).
    Requeue {
        #[arg(long)]
        reason: String,
        #[arg(long)]
        dry_run: bool,
        #[arg(required = true)]
        items: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// List a consumer's dead letters with their versions.
    List {
        #[arg(long)]
        consumer: String,
    },
    /// Replay dead letters given as MESSAGE_ID=VERSION (more than one creates an approval request).
    Replay {
        #[arg(long)]
        consumer: String,
        #[arg(long)]
        reason: String,
        #[arg(long)]
        dry_run: bool,
        #[arg(required = true)]
        items: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum OrderedCommand {
    /// An ordered consumer's partitions and stuck aggregates, with their versions.
    Show {
        #[arg(long)]
        consumer: String,
    },
    /// Act on a stuck aggregate: retry (runs now), skip or dead_letter_run (create an approval
    /// request; `--dry-run` says what they would dead-letter).
    Act {
        #[arg(long)]
        consumer: String,
        /// retry, skip, dead_letter_run.
        action: String,
        #[arg(long)]
        aggregate_type: String,
        #[arg(long)]
        aggregate_id: String,
        /// The applied position you saw (`show`).
        #[arg(long)]
        version: i64,
        #[arg(long)]
        reason: String,
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Debug, Subcommand)]
enum ApprovalCommand {
    /// List approval requests.
    List {
        #[arg(long)]
        status: Option<String>,
    },
    /// Approve a request of someone else.
    Approve {
        id: uuid::Uuid,
        #[arg(long)]
        reason: String,
        #[arg(long, default_value_t = 1)]
        version: i32,
    },
    /// Reject a request of someone else.
    Reject {
        id: uuid::Uuid,
        #[arg(long)]
        reason: String,
        #[arg(long, default_value_t = 1)]
        version: i32,
    },
}

#[derive(Debug, Subcommand)]
enum ProcessCommand {
    /// List processes, manual_review first.
    List {
        #[arg(long)]
        kind: Option<String>,
        #[arg(long)]
        status: Option<String>,
        /// Only processes created at least this many seconds ago.
        #[arg(long)]
        older_than_seconds: Option<i64>,
    },
    /// One process: its steps, last classified error, history and the actions allowed now.
    Show { id: uuid::Uuid },
    /// Perform an action the process offers now (see `show`); run_compensation and
    /// resolve_succeeded create an approval request.
    Act {
        id: uuid::Uuid,
        /// rerun_step, query_remote_status, escalate, pause, resume, run_compensation,
        /// resolve_succeeded, resolve_failed.
        action: String,
        #[arg(long)]
        reason: String,
        /// The process version you saw (`show`).
        #[arg(long)]
        version: i64,
        /// The step's number for step actions (may be left out when only one step offers it).
        #[arg(long)]
        step: Option<i32>,
        /// Evidence for resolve_succeeded (a provider reference, a ticket).
        #[arg(long)]
        evidence: Option<String>,
        /// For resolve_failed on a step whose outcome is unknown: what you checked at the remote
        /// (with `--answer`).
        #[arg(long, requires = "answer")]
        checked: Option<String>,
        /// For resolve_failed on a step whose outcome is unknown: the remote's answer.
        #[arg(long, requires = "checked")]
        answer: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum AuditCommand {
    /// Write the audit log as JSON lines, oldest first.
    Export {
        #[arg(long)]
        since: Option<String>,
    },
}

fn key() -> String {
    uuid::Uuid::new_v4().to_string()
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
            let pool =
                plumbing::db::connect(&cli.serve.db.database_url, 1, "console-migrate").await?;
            plumbing::db::migrate(&pool, &cli.serve.db.schema).await?;
            println!("migrations applied in schema {}", cli.serve.db.schema);
        }
        Command::User { command } => {
            let db = match &command {
                UserCommand::Create { db, .. }
                | UserCommand::Revoke { db, .. }
                | UserCommand::List { db } => db.clone(),
            };
            let pool = plumbing::db::connect(&db.database_url, 1, "console-user")
                .await
                .context("connecting to PostgreSQL")?;
            plumbing::db::migrate(&pool, &db.schema).await?;
            match command {
                UserCommand::Create {
                    name,
                    role,
                    replace,
                    ..
                } => {
                    if replace {
                        console::users::revoke(&pool, &db.schema, &name).await?;
                    }
                    let (user, token) =
                        console::users::create(&pool, &db.schema, &name, role).await?;
                    writeln!(
                        out,
                        "created user {} ({}) with role {}; its token (shown once):",
                        shared::display::escape_control(&user.name),
                        user.id,
                        user.role
                    )?;
                    writeln!(out, "{token}")?;
                }
                UserCommand::Revoke { name, .. } => {
                    if !console::users::revoke(&pool, &db.schema, &name).await? {
                        anyhow::bail!(
                            "no active user named {}",
                            shared::display::escape_control(&name)
                        );
                    }
                    writeln!(out, "revoked {}", shared::display::escape_control(&name))?;
                }
                UserCommand::List { .. } => {
                    for u in console::users::list(&pool, &db.schema).await? {
                        writeln!(
                            out,
                            "{}  {:<9} {}",
                            u.id,
                            u.role,
                            shared::display::escape_control(&u.name)
                        )?;
                    }
                }
            }
        }
        Command::Dead { client: c, command } => {
            let api = Client::new(&c.url, &c.token);
            match command {
                DeadCommand::List => {
                    client::print_dead(&api.get("/api/outbox/dead").await?, &mut out)?
                }
                DeadCommand::Requeue {
                    reason,
                    dry_run,
                    items,
                } => {
                    let mut parsed = Vec::new();
                    for i in &items {
                        let (id, version) = i
                            .split_once(':')
                            .with_context(|| format!("{i:?}: expected ID:VERSION"))?;
                        parsed.push(json!({"id": id, "version": version.parse::<i64>().context("VERSION is a number")?}));
                    }
                    let body = json!({"reason": reason, "dry_run": dry_run, "items": parsed});
                    let (status, body) = api
                        .post("/api/outbox/dead/actions/requeue", &body, &key())
                        .await?;
                    client::print_outcome(status, &body, &mut out)?;
                }
            }
        }
        Command::Dlq { client: c, command } => {
            let api = Client::new(&c.url, &c.token);
            match command {
                DlqCommand::List { consumer } => {
                    let q = format!(
                        "/api/dead-letters?consumer={}",
                        console::web::url_encode(&consumer)
                    );
                    client::print_dead_letters(&api.get(&q).await?, &mut out)?;
                }
                DlqCommand::Replay {
                    consumer,
                    reason,
                    dry_run,
                    items,
                } => {
                    let mut parsed = Vec::new();
                    for i in &items {
                        let (id, version) = i.split_once('=').unwrap_or((i.as_str(), ""));
                        parsed.push(json!({"message_id": id, "version": version}));
                    }
                    let body = json!({"reason": reason, "dry_run": dry_run, "items": parsed});
                    let path = format!(
                        "/api/dead-letters/{}/actions/replay",
                        console::web::url_encode(&consumer)
                    );
                    let (status, body) = api.post(&path, &body, &key()).await?;
                    client::print_outcome(status, &body, &mut out)?;
                }
            }
        }
        Command::Approvals { client: c, command } => {
            let api = Client::new(&c.url, &c.token);
            match command {
                ApprovalCommand::List { status } => {
                    let q = match status {
                        Some(s) => {
                            format!("/api/approvals?status={}", console::web::url_encode(&s))
                        }
                        None => "/api/approvals".to_string(),
                    };
                    client::print_approvals(&api.get(&q).await?, &mut out)?;
                }
                ApprovalCommand::Approve {
                    id,
                    ref reason,
                    version,
                }
                | ApprovalCommand::Reject {
                    id,
                    ref reason,
                    version,
                } => {
                    let verb = if matches!(command, ApprovalCommand::Approve { .. }) {
                        "approve"
                    } else {
                        "reject"
                    };
                    let (status, body) = api
                        .post(
                            &format!("/api/approvals/{id}/{verb}"),
                            &json!({"reason": reason, "version": version}),
                            &key(),
                        )
                        .await?;
                    client::print_outcome(status, &body, &mut out)?;
                }
            }
        }
        Command::Process { client: c, command } => {
            let api = Client::new(&c.url, &c.token);
            match command {
                ProcessCommand::List {
                    kind,
                    status,
                    older_than_seconds,
                } => {
                    let mut q = Vec::new();
                    if let Some(k) = kind {
                        q.push(format!("kind={}", console::web::url_encode(&k)));
                    }
                    if let Some(s) = status {
                        q.push(format!("status={}", console::web::url_encode(&s)));
                    }
                    if let Some(o) = older_than_seconds {
                        q.push(format!("older_than_seconds={o}"));
                    }
                    let path = format!("/api/processes?{}", q.join("&"));
                    client::print_processes(&api.get(&path).await?, &mut out)?;
                }
                ProcessCommand::Show { id } => {
                    client::print_process(
                        &api.get(&format!("/api/processes/{id}")).await?,
                        &mut out,
                    )?;
                }
                ProcessCommand::Act {
                    id,
                    action,
                    reason,
                    version,
                    step,
                    evidence,
                    checked,
                    answer,
                } => {
                    let mut body = json!({"reason": reason, "version": version, "step": step, "evidence": evidence});
                    if let (Some(checked), Some(answer)) = (checked, answer) {
                        body["remote_check"] = json!({"checked": checked, "answer": answer});
                    }
                    let path = format!(
                        "/api/processes/{id}/actions/{}",
                        console::web::url_encode(&action)
                    );
                    let (status, body) = api.post(&path, &body, &key()).await?;
                    client::print_outcome(status, &body, &mut out)?;
                }
            }
        }
        Command::Ordered { client: c, command } => {
            let api = Client::new(&c.url, &c.token);
            match command {
                OrderedCommand::Show { consumer } => {
                    let path = format!(
                        "/api/consumers/{}/ordered",
                        console::web::url_encode(&consumer)
                    );
                    client::print_ordered(&api.get(&path).await?, &mut out)?;
                }
                OrderedCommand::Act {
                    consumer,
                    action,
                    aggregate_type,
                    aggregate_id,
                    version,
                    reason,
                    dry_run,
                } => {
                    let body = json!({"aggregate_type": aggregate_type, "aggregate_id": aggregate_id,
                        "version": version, "reason": reason, "dry_run": dry_run});
                    let path = format!(
                        "/api/consumers/{}/ordered/actions/{}",
                        console::web::url_encode(&consumer),
                        console::web::url_encode(&action)
                    );
                    let (status, body) = api.post(&path, &body, &key()).await?;
                    client::print_outcome(status, &body, &mut out)?;
                }
            }
        }
        Command::Audit { client: c, command } => {
            let api = Client::new(&c.url, &c.token);
            match command {
                AuditCommand::Export { since } => {
                    let mut q = "/api/audit?format=jsonl".to_string();
                    if let Some(s) = since {
                        q.push_str(&format!("&since={}", console::web::url_encode(&s)));
                    }
                    // JSON lines escape control characters themselves: printed as received.
                    out.write_all(api.get_text(&q).await?.as_bytes())?;
                }
            }
        }
    }
    Ok(())
}
