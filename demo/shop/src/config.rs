//! Configuration: flags with env var fallbacks ([`Config`]) and the runtime knobs derived from them
//! ([`Settings`]), which tests build directly.

use crate::provider_webhooks::WebhookSecret;
use shared::schema::Schema;
use std::net::SocketAddr;
use std::time::Duration;

/// Everything `producer` (the binary) takes, as flags or env vars.
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Address the HTTP API (and /metrics, /healthz, /readyz, /openapi.json) listens on.
    #[arg(long, env = "LISTEN_ADDR", default_value = "127.0.0.1:8080")]
    pub listen_addr: SocketAddr,
    /// PostgreSQL connection string.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub database_url: String,
    /// The product schema (outbox, idempotency records); the demo's own tables are in `demo`.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = shared::schema::DEFAULT)]
    pub schema: Schema,
    /// Size of the PostgreSQL connection pool.
    #[arg(long, env = "DB_MAX_CONNECTIONS", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(2..=200))]
    pub db_max_connections: u32,
    /// How long to keep retrying to connect and migrate at start, in seconds.
    #[arg(long, env = "DB_CONNECT_DEADLINE_SECS", default_value_t = 60)]
    pub db_connect_deadline_secs: u64,
    /// Export spans over OTLP/HTTP to this collector (e.g. `http://127.0.0.1:4318`); off when unset.
    /// The events' `traceparent` then points at the request's span.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// How long an idempotency key is kept, in seconds; afterwards the same key counts as new.
    #[arg(long, env = "IDEMPOTENCY_TTL_SECS", default_value_t = 86_400,
          value_parser = clap::value_parser!(u64).range(1..=31_536_000))]
    pub idempotency_ttl_secs: u64,
    /// Lease of a processing record, in seconds: after it, a retry with the same key takes the
    /// record over (the holder is presumed dead). Longer than any request may take.
    #[arg(long, env = "IDEMPOTENCY_LEASE_SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub idempotency_lease_secs: u64,
    /// Largest accepted request body in bytes; larger ones get 413.
    #[arg(long, env = "BODY_LIMIT_BYTES", default_value_t = 65_536)]
    pub body_limit_bytes: usize,
    /// Seconds between two runs of the purge of expired idempotency records.
    #[arg(long, env = "PURGE_INTERVAL_SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub purge_interval_secs: u64,
    /// Records deleted per purge statement (bounded batches keep locks and WAL bursts small).
    #[arg(long, env = "PURGE_BATCH_SIZE", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub purge_batch_size: u32,
    /// How long received webhook events are kept in the inbox (their duplicates are recognised
    /// that long); older ones are purged every PURGE_INTERVAL_SECS. Keep it well beyond the
    /// provider's retry period (Stripe retries for 3 days).
    #[arg(long, env = "WEBHOOK_INBOX_RETENTION", default_value = "7d",
          value_parser = humantime::parse_duration)]
    pub webhook_inbox_retention: Duration,
    /// What the payment provider supports, for the payment process's charge step:
    /// `honours_key` (PROVIDER_IDEMPOTENCY=on), `queryable` (keys off, PROVIDER_STATUS_QUERY=on)
    /// or `none` (both off: an unknown outcome goes to manual review). The API records it with
    /// each process it starts; give the API and `producer worker` the same value.
    #[arg(long, env = "PAYMENT_REMOTE", default_value = "honours_key",
          value_parser = crate::payment_process::parse_remote)]
    pub payment_remote: processes::Remote,
    /// The secret the payment provider signs its webhooks with: when set, `POST
    /// /webhooks/provider` receives them (give the provider the same PROVIDER_WEBHOOK_SECRET).
    #[arg(long, env = "PROVIDER_WEBHOOK_SECRET", hide_env_values = true)]
    pub provider_webhook_secret: Option<String>,
}

impl Config {
    /// The runtime settings this configuration asks for.
    pub fn settings(&self) -> Settings {
        Settings {
            idempotency_ttl: Duration::from_secs(self.idempotency_ttl_secs),
            lease: Duration::from_secs(self.idempotency_lease_secs),
            body_limit: self.body_limit_bytes,
            purge_interval: Some(Duration::from_secs(self.purge_interval_secs)),
            purge_batch_size: self.purge_batch_size,
            purge_max_batches: 100,
            webhook_inbox_retention: self.webhook_inbox_retention,
            readiness_interval: Duration::from_secs(5),
            schema: self.schema.clone(),
            payment_remote: self.payment_remote,
            provider_webhook_secret: self
                .provider_webhook_secret
                .clone()
                .filter(|s| !s.is_empty())
                .map(WebhookSecret),
        }
    }
}

/// Runtime knobs of the API.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Retention of idempotency records (default 24 h).
    pub idempotency_ttl: Duration,
    /// Lease of a processing record before another request may take it over.
    pub lease: Duration,
    /// Largest accepted request body in bytes.
    pub body_limit: usize,
    /// Interval of the background purge; `None` disables it (call `idempotency::purge_expired`).
    pub purge_interval: Option<Duration>,
    /// Rows per purge statement.
    pub purge_batch_size: u32,
    /// Statements per purge run (bounds one run; the next run continues).
    pub purge_max_batches: u32,
    /// How long received webhook events stay in the inbox (purged with `purge_interval`).
    pub webhook_inbox_retention: Duration,
    /// Interval of the PostgreSQL check behind `/readyz`.
    pub readiness_interval: Duration,
    /// The product schema that holds the idempotency records (`outbox` by default).
    pub schema: Schema,
    /// What the payment provider supports (recorded with each payment process started).
    pub payment_remote: processes::Remote,
    /// Mounts `POST /webhooks/provider` when set.
    pub provider_webhook_secret: Option<WebhookSecret>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            idempotency_ttl: Duration::from_secs(86_400),
            lease: Duration::from_secs(30),
            body_limit: 65_536,
            purge_interval: Some(Duration::from_secs(60)),
            purge_batch_size: 1000,
            purge_max_batches: 100,
            webhook_inbox_retention: Duration::from_secs(7 * 86_400),
            readiness_interval: Duration::from_secs(5),
            schema: Schema::default(),
            payment_remote: processes::Remote::HonoursKey,
            provider_webhook_secret: None,
        }
    }
}
