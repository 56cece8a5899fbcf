//! The CLI's subcommands and flags (clap), below the top-level commands that `main` parses.

use crate::auth::roles::Role;
use crate::config::{ClientConfig, DbConfig};
use clap::{Args, Subcommand};

/// The subcommands that are clients of the console's API (`--url`, `--token`).
#[derive(Debug, Subcommand)]
pub enum ApiCommand {
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

/// `console user ...`: against the database directly (the API needs a user to exist first).
#[derive(Debug, Subcommand)]
pub enum UserCommand {
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

/// What a requeue or a replay is given: the items with their versions, why, and whether only to
/// say what each would do.
#[derive(Debug, clap::Args)]
pub struct Selection {
    #[arg(long)]
    pub reason: String,
    #[arg(long)]
    pub dry_run: bool,
    #[arg(required = true)]
    pub items: Vec<String>,
}

/// `console dead ...`: dead outbox rows, through the API.
#[derive(Debug, Subcommand)]
pub enum DeadCommand {
    /// List dead rows with their versions.
    List,
    /// Requeue rows given as ID:VERSION (more than one creates an approval request).
    Requeue(Selection),
}

/// `console dlq ...`: a consumer's dead letters, through the API.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List a consumer's dead letters with their versions.
    List {
        #[arg(long)]
        consumer: String,
    },
    /// Replay dead letters given as MESSAGE_ID=VERSION (more than one creates an approval request).
    Replay {
        #[arg(long)]
        consumer: String,
        #[command(flatten)]
        selection: Selection,
    },
}

/// `console ordered ...`: an ordered consumer's stuck aggregates, through the API.
#[derive(Debug, Subcommand)]
pub enum OrderedCommand {
    /// An ordered consumer's partitions and stuck aggregates, with their versions.
    Show {
        #[arg(long)]
        consumer: String,
    },
    /// Act on a stuck aggregate: retry (runs now), skip or dead_letter_run (create an approval
    /// request; `--dry-run` says what they would dead-letter).
    Act(OrderedAct),
}

/// `console approvals ...`: approval requests, through the API.
#[derive(Debug, Subcommand)]
pub enum ApprovalCommand {
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

/// `console process ...`: processes, through the API.
#[derive(Debug, Subcommand)]
pub enum ProcessCommand {
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
    Act(ProcessAct),
}

/// `console audit ...`: the audit log, through the API.
#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Write the audit log as JSON lines, oldest first.
    Export {
        #[arg(long)]
        since: Option<String>,
    },
}

/// `console process act`: an action on a process.
#[derive(Debug, Args)]
pub struct ProcessAct {
    pub id: uuid::Uuid,
    /// rerun_step, query_remote_status, escalate, pause, resume, run_compensation,
    /// resolve_succeeded, resolve_failed.
    pub action: String,
    #[arg(long)]
    pub reason: String,
    /// The process version you saw (`show`).
    #[arg(long)]
    pub version: i64,
    /// The step's number for step actions (may be left out when only one step offers it).
    #[arg(long)]
    pub step: Option<i32>,
    /// Evidence for resolve_succeeded (a provider reference, a ticket).
    #[arg(long)]
    pub evidence: Option<String>,
    /// For resolve_failed on a step whose outcome is unknown: what you checked at the remote
    /// (with `--answer`).
    #[arg(long, requires = "answer")]
    pub checked: Option<String>,
    /// For resolve_failed on a step whose outcome is unknown: the remote's answer.
    #[arg(long, requires = "checked")]
    pub answer: Option<String>,
}

/// `console ordered act`: an action on a stuck aggregate.
#[derive(Debug, Args)]
pub struct OrderedAct {
    #[arg(long)]
    pub consumer: String,
    /// retry, skip, dead_letter_run.
    pub action: String,
    #[arg(long)]
    pub aggregate_type: String,
    #[arg(long)]
    pub aggregate_id: String,
    /// The applied position you saw (`show`).
    #[arg(long)]
    pub version: i64,
    #[arg(long)]
    pub reason: String,
    #[arg(long)]
    pub dry_run: bool,
}
