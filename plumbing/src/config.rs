//! Connection settings every binary takes, as flags with env var fallbacks.

use std::net::SocketAddr;

/// Where PostgreSQL, RabbitMQ and the metrics endpoint are.
#[derive(Debug, Clone, clap::Args)]
pub struct Connections {
    /// PostgreSQL connection string.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub database_url: String,
    /// RabbitMQ connection string, or a comma-separated list of a cluster's nodes (each a full
    /// URL): a lost connection fails over to the next reachable node. A `heartbeat` query
    /// parameter is added when missing.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
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
