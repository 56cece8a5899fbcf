//! The console server's settings, as flags with env var fallbacks.

use plumbing::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};
use std::net::SocketAddr;
use std::time::Duration;

/// `console serve` settings.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeConfig {
    #[command(flatten)]
    pub db: DbConfig,
    /// RabbitMQ connection string (consumer dead letters).
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL)]
    pub amqp_url: String,
    #[command(flatten)]
    pub amqp_tls: plumbing::amqp_tls::AmqpTls,
    /// Address of the console (web page, API, /metrics, /healthz, /readyz).
    #[arg(long, env = "CONSOLE_ADDR", default_value = "127.0.0.1:8070")]
    pub addr: SocketAddr,
    /// Consumers whose dead letters the web page links to (comma-separated).
    #[arg(long, env = "CONSOLE_CONSUMERS", value_delimiter = ',')]
    pub consumers: Vec<String>,
    /// Web session lifetime in seconds.
    #[arg(long, env = "CONSOLE_SESSION_TTL_SECONDS", default_value_t = 8 * 3600)]
    pub session_ttl_seconds: u64,
    /// A web session unused for this many seconds ends (the next page asks for the login, and
    /// keeps the page asked for); the lifetime above ends it however busy.
    #[arg(long, env = "CONSOLE_SESSION_IDLE_SECONDS", default_value_t = 30 * 60)]
    pub session_idle_seconds: u64,
    /// Mark the session cookie Secure (set when the console is served over HTTPS).
    #[arg(long, env = "CONSOLE_COOKIE_SECURE", default_value_t = false, action = clap::ArgAction::Set)]
    pub cookie_secure: bool,
    /// Audit entries older than this many days are purged by `audit.purge` (admin).
    #[arg(long, env = "CONSOLE_AUDIT_RETENTION_DAYS", default_value_t = 365)]
    pub audit_retention_days: u32,
    /// An ordered consumer's aggregate waiting this many seconds for a missing message shows as
    /// stuck (use the consumers' `--gap-timeout`).
    #[arg(long, env = "CONSOLE_ORDERED_GAP_SECONDS", default_value_t = 60)]
    pub ordered_gap_seconds: u64,
    /// Failed logins allowed per client address per minute.
    #[arg(long, env = "CONSOLE_LOGIN_ATTEMPTS_PER_MINUTE", default_value_t = 5)]
    pub login_attempts_per_minute: usize,
    /// More field names whose values are always redacted (comma-separated; `token`, `password`,
    /// `card_number`, `email` ... are always).
    #[arg(long, env = "CONSOLE_SECRET_FIELDS", value_delimiter = ',')]
    pub secret_fields: Vec<String>,
    #[command(flatten)]
    pub look: LookConfig,
}

/// What the pages link to and how often the overview's charts are sampled.
#[derive(Debug, Clone, clap::Args)]
pub struct LookConfig {
    /// Grafana's base URL (`https://grafana.example`): the overview's charts link to the matching
    /// panels of the provisioned dashboards.
    #[arg(long, env = "CONSOLE_GRAFANA_URL")]
    pub grafana_url: Option<String>,
    /// A trace viewer's URL with `{trace_id}` in it (`https://jaeger.example/trace/{trace_id}`):
    /// a process or message carrying a W3C traceparent links to its trace.
    #[arg(long, env = "CONSOLE_TRACE_URL")]
    pub trace_url: Option<String>,
    /// The remote's page of a reference, with `{ref}` in it
    /// (`https://provider.example/charges/{ref}`): a step's remote reference links there.
    #[arg(long, env = "CONSOLE_REMOTE_URL")]
    pub remote_url: Option<String>,
    /// How often the sampler records the overview's figures, in milliseconds.
    #[arg(long, env = "CONSOLE_SAMPLE_INTERVAL_MS", default_value_t = 60_000)]
    pub sample_interval_ms: u64,
}

impl Default for LookConfig {
    fn default() -> Self {
        Self {
            grafana_url: None,
            trace_url: None,
            remote_url: None,
            sample_interval_ms: 60_000,
        }
    }
}

impl LookConfig {
    /// The sampling interval, at least 100 ms.
    pub fn sample_interval(&self) -> Duration {
        Duration::from_millis(self.sample_interval_ms.max(100))
    }
}

impl ServeConfig {
    pub fn session_ttl(&self) -> Duration {
        Duration::from_secs(self.session_ttl_seconds.max(60))
    }
    /// The idle timeout, at least a second.
    pub fn session_idle(&self) -> Duration {
        Duration::from_secs(self.session_idle_seconds.max(1))
    }
}

/// Where the product's tables are.
#[derive(Debug, Clone, clap::Args)]
pub struct DbConfig {
    /// PostgreSQL connection string.
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
    /// The PostgreSQL schema that holds the product's tables.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = shared::schema::DEFAULT)]
    pub schema: shared::schema::Schema,
}

/// Where the console is, for the CLI subcommands (clients of the API).
#[derive(Debug, Clone, clap::Args)]
pub struct ClientConfig {
    /// The console's URL.
    #[arg(long, env = "CONSOLE_URL", default_value = "http://127.0.0.1:8070")]
    pub url: String,
    /// Your token (from `console user create`).
    #[arg(long, env = "CONSOLE_TOKEN", hide_env_values = true)]
    pub token: String,
}

/// Settings the handlers read.
#[derive(Debug, Clone)]
pub struct Settings {
    /// RabbitMQ (URL, TLS files), for consumer dead letters.
    pub amqp_url: String,
    pub amqp_tls: plumbing::amqp_tls::AmqpTls,
    /// Consumers whose dead letters the web page offers.
    pub consumers: Vec<String>,
    /// Web session lifetime.
    pub session_ttl: Duration,
    /// A web session unused this long ends.
    pub session_idle: Duration,
    /// Mark the session cookie `Secure` (serve over HTTPS, e.g. behind a proxy).
    pub cookie_secure: bool,
    /// Audit entries older than this are purged (admin action `audit.purge`).
    pub audit_retention_days: u32,
    /// An ordered consumer's aggregate waiting this long for a missing message shows as stuck.
    pub ordered_gap_after: Duration,
    /// Where the pages link to (Grafana, traces, the remote) and the sampling interval.
    pub look: LookConfig,
}
