//! Connection settings every binary takes, as flags with env var fallbacks.

use std::net::SocketAddr;

/// PostgreSQL's connection string when none is given (`--database-url`, `DATABASE_URL`): the
/// local development database. The console and the tools take the same default from here.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// RabbitMQ's connection string when none is given (`--amqp-url`, `AMQP_URL`): the local broker.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Where PostgreSQL, RabbitMQ and the metrics endpoint are.
#[derive(Debug, Clone, clap::Args)]
pub struct Connections {
    /// PostgreSQL connection string. TLS: `sslmode=require|verify-ca|verify-full` with
    /// `sslrootcert=<CA file>` (and `sslcert`/`sslkey` for a client certificate) as query parameters.
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
    /// A direct PostgreSQL connection string, for what needs a session of its own when
    /// DATABASE_URL goes through PgBouncer in transaction mode: the relay's LISTEN and the
    /// migrations at start. Unset: both use DATABASE_URL, or, with `--database-pooler
    /// transaction`, the relay polls and nothing migrates at start (run `relay migrate` directly).
    #[arg(long, env = "DATABASE_DIRECT_URL")]
    pub database_direct_url: Option<String>,
    /// What DATABASE_URL goes through: `none` (PostgreSQL itself, or a session-pooling proxy) or
    /// `transaction` (PgBouncer `pool_mode = transaction`): no session parameters are sent on it and
    /// nothing session-bound (LISTEN, the migrations' advisory lock) runs over it.
    #[arg(long, env = "DATABASE_POOLER", value_enum, default_value_t = crate::db::Pooler::None)]
    pub database_pooler: crate::db::Pooler,
    /// RabbitMQ connection string, or a comma-separated list of a cluster's nodes (each a full
    /// URL): a lost connection fails over to the next reachable node. A `heartbeat` query
    /// parameter is added when missing. A `frame_max` below 8192 is refused at start
    /// ([`crate::amqp::check_frame_max`]; RabbitMQ 4.1 and later refuse it).
    #[arg(long, env = "AMQP_URL", default_value = DEFAULT_AMQP_URL)]
    pub amqp_url: String,
    /// Certificates for `amqps://` URLs.
    #[command(flatten)]
    pub amqp_tls: crate::amqp_tls::AmqpTls,
    /// The PostgreSQL schema that holds the product's tables and migration history.
    #[arg(long, env = "OUTBOX_SCHEMA", default_value = shared::schema::DEFAULT)]
    pub schema: shared::schema::Schema,
    /// The topic exchange events are published to.
    #[arg(long, env = "OUTBOX_EXCHANGE", default_value = "outbox.events")]
    pub exchange: String,
    /// Address of the HTTP server for /metrics, /healthz and /readyz.
    #[arg(long, env = "METRICS_ADDR", default_value = "127.0.0.1:9100")]
    pub metrics_addr: SocketAddr,
    /// Export spans over OTLP/HTTP to this collector (e.g. `http://127.0.0.1:4318`); off when unset.
    /// Spans continue each message's `traceparent`.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl Connections {
    /// The PostgreSQL side of these settings.
    pub fn database(&self) -> crate::db::Target<'_> {
        crate::db::Target {
            url: &self.database_url,
            direct_url: self.database_direct_url.as_deref(),
            pooler: self.database_pooler,
        }
    }
}
