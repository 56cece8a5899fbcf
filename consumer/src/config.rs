//! Settings: the library's [`Config`], and [`Settings`], the flags and env vars that build it.

use crate::error::ConfigError;
use shared::schema::Schema;
use std::net::SocketAddr;
use std::time::Duration;

/// Everything [`crate::run`] needs besides the database pool and the handlers.
///
/// Build it with [`Config::new`] (defaults for everything else) and adjust the public fields,
/// or from the command line with [`Settings::into_config`]. [`crate::run`] validates it.
#[derive(Debug, Clone)]
pub struct Config {
    /// Consumer name. It scopes deduplication (two differently named consumers of one message each
    /// apply their own effect once) and names the queues; instances of one service share one name.
    pub name: String,
    /// RabbitMQ connection string (heartbeats are added when missing).
    pub amqp_url: String,
    /// CA (and client certificate) files for an `amqps://` URL.
    pub amqp_tls: plumbing::amqp_tls::AmqpTls,
    /// Topic exchange the relay publishes to; declared here too, so either side may start first.
    pub exchange: String,
    /// Binding keys (AMQP topic patterns) of the consumer's queue. Empty: the handlers' patterns
    /// (and `#` when there is a catch-all handler).
    pub bindings: Vec<String>,
    /// Concurrent workers, each with its own channel and database connection: batches of
    /// different workers are processed in parallel.
    pub workers: usize,
    /// Unacknowledged deliveries the broker may push to each worker. At least the batch size,
    /// so the next batch is waiting while one commits.
    pub prefetch: u16,
    /// Most deliveries processed in one database transaction (one commit, one multi-ack).
    pub batch_size: usize,
    /// Handler runs per message before a transient failure is dead-lettered (1 = never retry).
    pub max_attempts: u32,
    /// Delay before retry 1, 2, ...; the last one repeats. One retry queue per distinct delay.
    pub retry_delays: Vec<Duration>,
    /// Dead-letter messages of an event type no handler is registered for, instead of
    /// acknowledging and ignoring them.
    pub strict: bool,
    /// Longest a handler may run; a timeout counts as a transient failure.
    pub handler_timeout: Duration,
    /// How long deduplication rows are kept. Must exceed the longest redelivery or replay
    /// horizon: a copy arriving after its row was deleted would be applied again.
    pub retention: Duration,
    /// How often the retention sweep runs.
    pub retention_interval: Duration,
    /// Rows the sweep deletes per statement (bounded transactions, short locks).
    pub retention_batch: i64,
    /// Where to serve `/metrics`, `/healthz`, `/readyz`; `None` when the embedding service serves
    /// them itself (see [`crate::Consumer::readiness`]).
    pub metrics_addr: Option<SocketAddr>,
    /// Fault injection for tests: wait this long between commit and ack, to widen the window in
    /// which a crash leaves committed but unacknowledged deliveries. Zero in production.
    pub ack_delay: Duration,
    /// The product schema that holds `processed_messages` (`outbox` by default).
    pub schema: Schema,
    /// Whether the runtime's deduplication statements are named prepared statements, cached per
    /// connection (the default). `false` behind a transaction pooler that does not keep them
    /// (PgBouncer before 1.21): unnamed, one round trip more per batch. The binaries set it from
    /// `DATABASE_POOLER`.
    pub named_statements: bool,
    /// Log a warning for each delivery whose `x-delivery-count` (the broker's count of failed
    /// deliveries, quorum queues) reaches this: the message nears the queue's delivery limit
    /// (20 by default on RabbitMQ 4.x), past which the broker dead-letters or drops it. 0: never.
    pub redelivery_warning: u32,
    /// How long the broker lets a delivery stay unacknowledged before it cancels the consumer
    /// (`x-consumer-timeout` on `basic.consume`; sent only to brokers from 3.11.15, older ones
    /// keep their global `consumer_timeout`). Above the longest a batch can hold its deliveries
    /// in normal operation; a database outage longer than this makes the broker take them back.
    /// Zero: not sent (the broker's default, 30 minutes).
    pub consumer_timeout: Duration,
    /// Ordered mode (see [`crate::ordered`]): each aggregate's messages are applied in
    /// `aggregate_seq` order across all instances; traffic is split over [`Config::partitions`]
    /// partition queues, each consumed by one instance at a time.
    pub ordered: bool,
    /// Ordered mode: partition queues (`NAME.ordered.0` ..). Fixed by the consumer's first
    /// instance; every instance must use the same count.
    pub partitions: u16,
    /// Ordered mode: how long a message may wait for a missing predecessor before the gap is
    /// reported (metric, log, console). It keeps waiting: a missing message is never guessed.
    pub gap_timeout: Duration,
    /// Ordered mode: partition lease. An instance that dies holds its partitions at most this
    /// long; a live one renews every quarter of it.
    pub lease: Duration,
    /// Ordered mode: this instance's id in the consumer group (default: host and a random suffix).
    pub instance_id: String,
    /// Weighted fair share by a key header (see [`crate::fair`]): the queue is sorted into lanes
    /// by key, worked side by side, so one key's burst holds its own lane only. Unordered mode.
    pub fair_share: Option<crate::fair::FairShare>,
}

/// Default of [`Config::partitions`] (ordered mode).
pub const DEFAULT_PARTITIONS: u16 = 8;

/// Default of [`Config::redelivery_warning`]: three quarters of RabbitMQ 4.x's default delivery
/// limit (20).
pub const DEFAULT_REDELIVERY_WARNING: u32 = 15;

impl Config {
    /// A configuration with the defaults of the command line.
    pub fn new(
        name: impl Into<String>,
        amqp_url: impl Into<String>,
        exchange: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            amqp_url: amqp_url.into(),
            amqp_tls: plumbing::amqp_tls::AmqpTls::default(),
            exchange: exchange.into(),
            bindings: Vec::new(),
            workers: 2,
            prefetch: 200,
            batch_size: 100,
            max_attempts: 5,
            retry_delays: vec![
                Duration::from_secs(1),
                Duration::from_secs(10),
                Duration::from_secs(60),
                Duration::from_secs(300),
            ],
            strict: false,
            handler_timeout: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
            retention_interval: Duration::from_secs(300),
            retention_batch: 5000,
            metrics_addr: None,
            ack_delay: Duration::ZERO,
            schema: Schema::default(),
            named_statements: true,
            redelivery_warning: DEFAULT_REDELIVERY_WARNING,
            consumer_timeout: Duration::from_secs(3600),
            ordered: false,
            partitions: DEFAULT_PARTITIONS,
            gap_timeout: Duration::from_secs(60),
            lease: Duration::from_secs(10),
            instance_id: plumbing::membership::instance_id(),
            fair_share: None,
        }
    }

    /// Checks the settings; [`crate::run`] calls it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_name(&self.name)?;
        plumbing::amqp::check_frame_max(&self.amqp_url)?;
        if self.workers == 0 {
            return Err(ConfigError::Zero("workers"));
        }
        if self.batch_size == 0 {
            return Err(ConfigError::Zero("batch size"));
        }
        if self.prefetch == 0 {
            return Err(ConfigError::Zero("prefetch"));
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::Zero("max attempts"));
        }
        if self.max_attempts > 1 && self.retry_delays.is_empty() {
            return Err(ConfigError::NoRetryDelays);
        }
        if self
            .retry_delays
            .iter()
            .any(|d| d.is_zero() || d.as_millis() > u128::from(u32::MAX))
        {
            return Err(ConfigError::RetryDelayOutOfRange);
        }
        if self.retention_batch <= 0 {
            return Err(ConfigError::Zero("retention batch"));
        }
        if self.retention_interval.is_zero() {
            return Err(ConfigError::Zero("retention interval"));
        }
        if !self.consumer_timeout.is_zero() && self.consumer_timeout <= self.handler_timeout {
            return Err(ConfigError::ConsumerTimeoutTooShort {
                consumer_timeout: self.consumer_timeout,
                handler_timeout: self.handler_timeout,
            });
        }
        let horizon = self.retry_horizon();
        if self.retention <= horizon {
            return Err(ConfigError::RetentionTooShort {
                retention: self.retention,
                horizon,
            });
        }
        for b in &self.bindings {
            if b.is_empty() || b.len() > 255 {
                return Err(ConfigError::InvalidBinding(b.clone()));
            }
        }
        if let Some(share) = &self.fair_share {
            if self.ordered {
                return Err(ConfigError::FairShareOrdered);
            }
            share.check().map_err(ConfigError::FairShare)?;
        }
        if self.ordered {
            if self.strict {
                return Err(ConfigError::StrictOrdered);
            }
            if !(1..=64).contains(&self.partitions) {
                return Err(ConfigError::Partitions(self.partitions));
            }
            if self.lease < Duration::from_secs(2) {
                return Err(ConfigError::LeaseTooShort(self.lease));
            }
        }
        Ok(())
    }

    /// Delay before retry number `retry` (1-based): the last configured delay repeats.
    pub fn retry_delay(&self, retry: u32) -> Duration {
        let i = (retry.max(1) as usize - 1).min(self.retry_delays.len().saturating_sub(1));
        self.retry_delays.get(i).copied().unwrap_or(Duration::ZERO)
    }

    /// Longest time from the first delivery of a message to its last retry.
    pub fn retry_horizon(&self) -> Duration {
        (1..self.max_attempts).map(|r| self.retry_delay(r)).sum()
    }

    /// Database connections [`crate::run`] uses: one per worker (a fair share's lane workers
    /// included), one for the retention sweep and one for the health probe.
    pub fn pool_size(&self) -> u32 {
        if self.ordered {
            // A worker per partition held (at most all of them), the heartbeat, the sweep's read
            // and the health probe.
            return u32::from(self.partitions).saturating_add(3);
        }
        let lanes = self.fair_share.as_ref().map_or(0, |f| f.lane_workers());
        u32::try_from(self.workers + lanes)
            .unwrap_or(u32::MAX)
            .saturating_add(2)
    }
}

/// The longest consumer name, in bytes.
pub const MAX_NAME_LEN: usize = 200;

/// A consumer name becomes part of queue names: keep it to what every tool displays plainly.
/// Public so that tools naming a consumer (the console) accept exactly the names a consumer does.
pub fn validate_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::InvalidName(name.to_string()))
    }
}

/// The consumer's command-line flags (each with an env var), as the `consumer` binary takes them.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Consumer name: scopes deduplication and names the queue (`NAME`), the retry queues
    /// (`NAME.retry.DELAY`), the dead-letter exchange (`NAME.dlx`) and queue (`NAME.dlq`).
    /// Instances of one service share a name; different services use different names.
    #[arg(long, env = "CONSUMER_NAME")]
    pub name: String,
    /// Binding keys of the queue on the outbox exchange (topic patterns: `*` one word, `#` any
    /// number). Repeat the flag or separate with commas. Default: the registered handlers' patterns.
    #[arg(long = "bind", env = "CONSUMER_BINDINGS", value_delimiter = ',')]
    pub bindings: Vec<String>,
    #[command(flatten)]
    pub connections: plumbing::config::Connections,
    /// Concurrent workers, each with its own AMQP channel and database connection.
    #[arg(long, env = "CONSUMER_WORKERS", default_value_t = 2)]
    pub workers: usize,
    /// Unacknowledged deliveries per worker (AMQP prefetch). Keep it at least the batch size.
    #[arg(long, env = "CONSUMER_PREFETCH", default_value_t = 200)]
    pub prefetch: u16,
    /// Most deliveries per database transaction: one commit and one multi-ack per batch.
    #[arg(long, env = "CONSUMER_BATCH_SIZE", default_value_t = 100)]
    pub batch_size: usize,
    /// Handler runs per message before a transient failure is dead-lettered (1 = no retries).
    #[arg(long, env = "CONSUMER_MAX_ATTEMPTS", default_value_t = 5)]
    pub max_attempts: u32,
    /// Delays before retry 1, 2, ... (comma-separated, e.g. `100ms,5s,1m`); the last repeats.
    /// Each distinct delay gets a retry queue whose messages expire back into the main queue.
    #[arg(long, env = "CONSUMER_RETRY_DELAYS", value_delimiter = ',', default_value = "1s,10s,1m,5m", value_parser = parse_duration)]
    pub retry_delays: Vec<Duration>,
    /// Dead-letter events no handler is registered for (default: acknowledge and ignore them).
    #[arg(long, env = "CONSUMER_STRICT")]
    pub strict: bool,
    /// Longest a handler may run before the attempt counts as a transient failure.
    #[arg(long, env = "CONSUMER_HANDLER_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub handler_timeout: Duration,
    /// How long deduplication rows are kept. Must exceed the longest redelivery or dead-letter
    /// replay horizon: a copy arriving later would be applied again.
    #[arg(long, env = "CONSUMER_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub retention: Duration,
    /// How often the retention sweep runs (one instance at a time, in bounded batches).
    #[arg(long, env = "CONSUMER_RETENTION_INTERVAL", default_value = "5m", value_parser = parse_duration)]
    pub retention_interval: Duration,
    /// Log a warning for each delivery whose `x-delivery-count` reaches this (the message nears
    /// the queue's delivery limit, 20 by default on RabbitMQ 4.x). 0: never.
    #[arg(long, env = "CONSUMER_REDELIVERY_WARNING", default_value_t = DEFAULT_REDELIVERY_WARNING)]
    pub redelivery_warning: u32,
    /// Delivery acknowledgement timeout of the consumer (`x-consumer-timeout`), sent to brokers
    /// from 3.11.15; `0s`: the broker's own (30 minutes by default).
    #[arg(long, env = "CONSUMER_TIMEOUT", default_value = "1h", value_parser = parse_duration)]
    pub consumer_timeout: Duration,
    /// Ordered mode: apply each aggregate's messages in `aggregate_seq` order across all
    /// instances (partition queues, leases; see docs/consumer.md, "Ordered consumers").
    #[arg(long, env = "CONSUMER_ORDERED")]
    pub ordered: bool,
    /// Ordered mode: partition queues; every instance of the consumer must use the same count.
    #[arg(long, env = "CONSUMER_PARTITIONS", default_value_t = DEFAULT_PARTITIONS)]
    pub partitions: u16,
    /// Ordered mode: how long a message waits for a missing predecessor before the gap is
    /// reported (it keeps waiting).
    #[arg(long, env = "CONSUMER_GAP_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub gap_timeout: Duration,
    /// Ordered mode: partition lease; a dead instance's partitions move after at most this.
    #[arg(long, env = "CONSUMER_LEASE", default_value = "10s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Weighted fair share by this message header (e.g. `tenant`): the queue is sorted into
    /// lanes by its value, worked side by side (unordered mode; see docs/consumer.md).
    #[arg(long, env = "CONSUMER_FAIR_SHARE_HEADER")]
    pub fair_share_header: Option<String>,
    /// Fair share: hashed lanes the keys without a weight are spread over.
    #[arg(long, env = "CONSUMER_FAIR_SHARE_LANES", default_value_t = 8)]
    pub fair_share_lanes: u16,
    /// Fair share: `KEY=WEIGHT` pairs (comma separated): a key's own lane, worked by WEIGHT
    /// workers.
    #[arg(long, env = "CONSUMER_FAIR_SHARE_WEIGHTS", value_delimiter = ',', value_parser = parse_weight)]
    pub fair_share_weights: Vec<(String, u16)>,
    /// Fault injection for tests: pause between commit and ack.
    #[arg(long, hide = true, default_value = "0ms", value_parser = parse_duration)]
    pub debug_ack_delay: Duration,
}

/// A `KEY=WEIGHT` pair of `--fair-share-weights`.
fn parse_weight(s: &str) -> Result<(String, u16), String> {
    let (k, w) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected KEY=WEIGHT"))?;
    let w = w
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: the weight is a whole number from 1 to 16"))?;
    Ok((k.trim().to_string(), w))
}

impl Settings {
    /// The library configuration these flags describe, validated.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        let mut c = Config::new(
            self.name,
            self.connections.amqp_url,
            self.connections.exchange,
        );
        c.amqp_tls = self.connections.amqp_tls;
        c.bindings = self
            .bindings
            .into_iter()
            .map(|b| b.trim().to_string())
            .filter(|b| !b.is_empty())
            .collect();
        c.workers = self.workers;
        c.prefetch = self.prefetch;
        c.batch_size = self.batch_size;
        c.max_attempts = self.max_attempts;
        c.retry_delays = self.retry_delays;
        c.strict = self.strict;
        c.handler_timeout = self.handler_timeout;
        c.retention = self.retention;
        c.retention_interval = self.retention_interval;
        c.metrics_addr = Some(self.connections.metrics_addr);
        c.ack_delay = self.debug_ack_delay;
        c.redelivery_warning = self.redelivery_warning;
        c.consumer_timeout = self.consumer_timeout;
        c.schema = self.connections.schema;
        c.ordered = self.ordered;
        c.partitions = self.partitions;
        c.gap_timeout = self.gap_timeout;
        c.lease = self.lease;
        if let Some(header) = self.fair_share_header {
            let share = crate::fair::FairShare::by_header(header).lanes(self.fair_share_lanes);
            c.fair_share = Some(
                self.fair_share_weights
                    .into_iter()
                    .fold(share, |s, (k, w)| s.weight(k, w)),
            );
        } else if !self.fair_share_weights.is_empty() {
            return Err(ConfigError::FairShare(
                "fair share weights need a fair share header (--fair-share-header)".into(),
            ));
        }
        c.named_statements = self.connections.database_pooler == plumbing::db::Pooler::None;
        c.validate()?;
        Ok(c)
    }
}

/// Parses a duration as `humantime` does: `250ms`, `5s`, `2m`, `1h`, `7d`, `1h 30m`.
pub use humantime::parse_duration;

/// The shortest of `250ms`, `5s`, `2m`, `1h`, `7d` that is exact (used in retry queue names).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000u128),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms > 0 && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        for s in ["100ms", "1s", "90s", "2m", "1h", "7d", "1500ms"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
        assert_eq!(parse_duration("60s").unwrap(), Duration::from_secs(60));
        assert_eq!(format_duration(Duration::from_secs(60)), "1m");
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("5 fortnights").is_err());
    }

    /// A fair share works lanes side by side, which would reorder an aggregate: refused in ordered
    /// mode at start, with the rule; accepted in unordered mode.
    #[test]
    fn a_fair_share_is_refused_in_ordered_mode() {
        let mut config = Config::new("fair", "amqp://x", "outbox");
        config.fair_share = Some(crate::fair::FairShare::by_header("tenant"));
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        config.ordered = true;
        assert!(matches!(
            config.validate(),
            Err(ConfigError::FairShareOrdered)
        ));
    }

    /// `--ordered` and `CONSUMER_ORDERED` both turn ordered mode on in the config they build.
    #[test]
    fn ordered_mode_is_a_flag_and_an_environment_variable() {
        use clap::{CommandFactory, Parser};
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            settings: Settings,
        }
        let command = Cli::command();
        let ordered = command
            .get_arguments()
            .find(|a| a.get_id() == "ordered")
            .expect("an ordered flag");
        assert_eq!(ordered.get_long(), Some("ordered"));
        assert_eq!(
            ordered.get_env().and_then(|e| e.to_str()),
            Some("CONSUMER_ORDERED")
        );
        let cli =
            Cli::try_parse_from(["consumer", "--name", "ledger", "--ordered"]).expect("parses");
        let config = cli.settings.into_config().expect("valid");
        assert!(config.ordered);
    }

    #[test]
    fn retry_delays_repeat_the_last() {
        let mut c = Config::new("c", "amqp://x", "e");
        c.retry_delays = vec![Duration::from_millis(100), Duration::from_millis(500)];
        c.max_attempts = 4;
        assert_eq!(c.retry_delay(1), Duration::from_millis(100));
        assert_eq!(c.retry_delay(2), Duration::from_millis(500));
        assert_eq!(c.retry_delay(9), Duration::from_millis(500));
        assert_eq!(c.retry_horizon(), Duration::from_millis(1100));
        c.validate().unwrap();
    }

    #[test]
    fn validation_rejects_nonsense() {
        let base = Config::new("ledger", "amqp://x", "e");
        base.validate().unwrap();
        let mut c = base.clone();
        c.name = "bad name".into();
        assert!(matches!(c.validate(), Err(ConfigError::InvalidName(_))));
        let mut c = base.clone();
        c.retention = Duration::from_secs(60);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::RetentionTooShort { .. })
        ));
        let mut c = base.clone();
        c.workers = 0;
        assert!(c.validate().is_err());
        let mut c = base.clone();
        c.amqp_url = "amqp://guest:guest@127.0.0.1:5672/%2f?frame_max=4096".into();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::FrameMaxTooSmall(_))
        ));
        let mut c = base.clone();
        c.consumer_timeout = c.handler_timeout;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::ConsumerTimeoutTooShort { .. })
        ));
        let mut c = base;
        c.retry_delays.clear();
        assert!(matches!(c.validate(), Err(ConfigError::NoRetryDelays)));
    }
}
