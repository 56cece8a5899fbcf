//! Relay settings: flags with env var fallbacks, defaults that work against local services.

use crate::cloudevents;
use clap::ArgAction;
use plumbing::config::Connections;
use std::time::Duration;

/// Everything `relay::run` needs.
#[derive(Debug, Clone, clap::Args)]
pub struct RelayConfig {
    #[command(flatten)]
    pub connections: Connections,
    #[command(flatten)]
    pub options: RelayOptions,
}

/// How the relay claims, publishes and retries.
#[derive(Debug, Clone, clap::Args)]
pub struct RelayOptions {
    /// Rows claimed per round. Bigger batches amortize the claim and the mark over more publishes.
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=50_000))]
    pub batch_size: u32,
    /// Publishes in flight (sent, confirm not yet received) on the channel. RabbitMQ confirms in
    /// bulk, so a wide window is what makes publishing fast. 2,000: the relay-shaped ceiling was
    /// highest at 2,000 of 256/1,000/2,000 in most runs, and `bench relay-skew` drained closer to
    /// it with 2,000 than with 1,000 (README, "Performance").
    #[arg(long, env = "RELAY_WINDOW", default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub window: u32,
    /// Partition lease, in milliseconds. A relay that dies (SIGKILL, lost host) holds its
    /// partitions at most this long before the others take them over and publish its rows.
    #[arg(long, env = "RELAY_LEASE_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(500..))]
    pub lease_ms: u64,
    /// Fallback poll, in milliseconds, for notifications lost while the LISTEN connection was down.
    #[arg(long, env = "RELAY_POLL_INTERVAL_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
    pub poll_interval_ms: u64,
    /// How long to wait for the broker's confirm of a publish before giving up on the connection.
    /// A timeout is the link's failure, never charged to a row (it stays pending).
    #[arg(long, env = "RELAY_CONFIRM_TIMEOUT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..))]
    pub confirm_timeout_ms: u64,
    /// Failed attempts (nack, unroutable return, refusal) after which a row is dead. Broker or database
    /// outages do not count: they are waited out, not charged to the message.
    #[arg(long, env = "RELAY_MAX_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// Largest payload published, in bytes. A bigger row goes dead with the reason instead of being
    /// sent: RabbitMQ refuses messages over its `max_message_size` (128 MiB in 3.x, 16 MiB from
    /// 4.0) by closing the channel, which would fail every publish in flight. Keep it at or below
    /// the broker's setting.
    #[arg(long, env = "RELAY_MAX_PAYLOAD_BYTES", default_value_t = 16 * 1024 * 1024, value_parser = clap::value_parser!(u64).range(1..=(512 * 1024 * 1024)))]
    pub max_payload_bytes: u64,
    /// First retry delay in milliseconds; doubles per attempt, with full jitter.
    #[arg(long, env = "RELAY_RETRY_BASE_MS", default_value_t = 500)]
    pub retry_base_ms: u64,
    /// Largest retry delay in milliseconds.
    #[arg(long, env = "RELAY_RETRY_MAX_MS", default_value_t = 60_000)]
    pub retry_max_ms: u64,
    /// Keep published rows this many seconds before deleting them (0: delete at once when confirmed).
    #[arg(long, env = "RELAY_RETENTION_SECS", default_value_t = 0)]
    pub retention_secs: u64,
    /// Give the exchange an alternate exchange and queue `<exchange>.unrouted` that keeps events no
    /// queue is bound for yet. With `false`, such an event is returned and retried like a nack.
    #[arg(long, env = "RELAY_ALTERNATE_EXCHANGE", default_value_t = true, action = ArgAction::Set)]
    pub alternate_exchange: bool,
    /// How often backlog gauges (pending, oldest age, dead, unrouted) are refreshed, in milliseconds.
    #[arg(long, env = "RELAY_STATS_INTERVAL_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..))]
    pub stats_interval_ms: u64,
    /// PostgreSQL connections: LISTEN holds one; claim, mark, leases and stats use one each at a time.
    #[arg(long, env = "RELAY_DB_POOL_SIZE", default_value_t = 6, value_parser = clap::value_parser!(u32).range(2..))]
    pub db_pool_size: u32,
    /// CloudEvents binary mode: `binary` adds the event's CloudEvents attributes as
    /// `cloudEvents_*` headers (README, "CloudEvents binary mode"); body and content type stay as
    /// they are.
    /// Set it the same on every relay of one exchange.
    #[arg(long = "cloudevents", env = "RELAY_CLOUDEVENTS", value_enum, default_value_t = cloudevents::Mode::Off)]
    pub cloudevents: cloudevents::Mode,
    /// CloudEvents `source` base, a URI-reference without query or fragment: each event's source
    /// is `<base>/<aggregate_type>/<aggregate_id>`, both percent-encoded.
    #[arg(long, env = "RELAY_CLOUDEVENTS_SOURCE", default_value = "/outbox", value_parser = source_base)]
    pub cloudevents_source: String,
    /// Put before the event type to make the CloudEvents `type` (e.g. `com.example.`; none by default).
    #[arg(long, env = "RELAY_CLOUDEVENTS_TYPE_PREFIX", default_value = "")]
    pub cloudevents_type_prefix: String,
    /// Instance id in relay_instances and relay_partitions (default: hostname and a random suffix).
    #[arg(long, env = "RELAY_INSTANCE_ID")]
    pub instance_id: Option<String>,
}

/// Refuses a bad CloudEvents source base when the flags are read, not at the first publish.
fn source_base(s: &str) -> Result<String, cloudevents::SettingError> {
    cloudevents::Binary::new(s, "").map(|_| s.to_owned())
}

impl RelayOptions {
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms)
    }
    pub fn confirm_timeout(&self) -> Duration {
        Duration::from_millis(self.confirm_timeout_ms)
    }
    pub fn retry_delay(&self, attempt: u32) -> Duration {
        plumbing::backoff::delay(
            attempt,
            Duration::from_millis(self.retry_base_ms),
            Duration::from_millis(self.retry_max_ms.max(self.retry_base_ms)),
        )
    }
    pub fn stats_interval(&self) -> Duration {
        Duration::from_millis(self.stats_interval_ms)
    }
    /// The CloudEvents settings, checked: `None` when binary mode is off.
    pub fn cloudevents(&self) -> Result<Option<cloudevents::Binary>, cloudevents::SettingError> {
        match self.cloudevents {
            cloudevents::Mode::Off => Ok(None),
            cloudevents::Mode::Binary => {
                cloudevents::Binary::new(&self.cloudevents_source, &self.cloudevents_type_prefix)
                    .map(Some)
            }
        }
    }
}

impl Default for RelayOptions {
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            o: RelayOptions,
        }
        <P as clap::Parser>::parse_from(["relay"]).o
    }
}
