//! Error types of the runtime. Handler failures are [`crate::HandlerError`].

use std::time::Duration;

/// Why a [`crate::Config`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid consumer name {0:?}: use 1-200 characters of A-Z a-z 0-9 . _ -")]
    InvalidName(String),
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("retries are enabled (max attempts > 1) but no retry delay is configured")]
    NoRetryDelays,
    #[error("retry delays must be between 1 ms and 49 days")]
    RetryDelayOutOfRange,
    #[error(
        "retention {retention:?} must exceed the retry horizon {horizon:?}: a retried copy arriving after its \
         deduplication row was deleted would be applied again"
    )]
    RetentionTooShort {
        retention: Duration,
        horizon: Duration,
    },
    #[error("invalid binding key {0:?}")]
    InvalidBinding(String),
    #[error("no binding keys: configure some, or register a handler")]
    NoBindings,
    #[error(transparent)]
    FrameMaxTooSmall(#[from] plumbing::amqp::FrameMaxTooSmall),
    #[error(
        "consumer timeout {consumer_timeout:?} must exceed the handler timeout {handler_timeout:?}: \
         the broker would take deliveries back from a handler still within its time"
    )]
    ConsumerTimeoutTooShort {
        consumer_timeout: Duration,
        handler_timeout: Duration,
    },
    #[error(
        "strict mode and ordered mode exclude each other: in ordered mode an event without a \
         handler advances its aggregate's position (dead-lettering it would leave a gap that holds \
         the aggregate forever)"
    )]
    StrictOrdered,
    #[error("partitions must be 1 to 64, not {0}")]
    Partitions(u16),
    #[error("the partition lease must be at least 2s, not {0:?}")]
    LeaseTooShort(Duration),
    #[error(
        "a handler names a dependency, but no retry delay is configured: messages waiting for an \
         unavailable remote wait in the retry queues (set retry delays, or use ordered mode, which \
         waits in place)"
    )]
    DependencyWithoutRetryQueues,
    #[error(
        "a fair share needs unordered mode: lanes worked side by side would reorder an aggregate \
         (ordered mode shares by partition and keeps each aggregate's order)"
    )]
    FairShareOrdered,
    #[error("{0}")]
    FairShare(String),
}

/// Errors that end [`crate::run`]. Lost connections are not among them: the runtime reconnects.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    #[error("cannot serve /metrics on {addr}")]
    Ops {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Why one connection to RabbitMQ (a session) ended; the runtime logs it and reconnects.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("cannot connect to RabbitMQ")]
    Connect(#[from] plumbing::amqp::AmqpError),
    #[error("declaring the topology failed")]
    Topology(#[source] lapin::Error),
    #[error("opening a channel or consumer failed")]
    Channel(#[source] lapin::Error),
    #[error("the broker cancelled the consumer (queue deleted?)")]
    ConsumerCancelled,
    #[error("the delivery stream failed")]
    Delivery(#[source] lapin::Error),
    #[error("publishing a retry or dead letter failed")]
    Publish(#[source] lapin::Error),
    #[error("the broker did not accept a retry or dead letter: {0}")]
    NotConfirmed(String),
    #[error("acknowledging deliveries failed")]
    Ack(#[source] lapin::Error),
    #[error("the channel closed while the database was unavailable")]
    ChannelClosed,
    #[error("{0} timed out after {1:?}")]
    Timeout(&'static str, Duration),
    #[error("a worker task failed")]
    Worker(#[source] tokio::task::JoinError),
    #[error("partition {0} is no longer this instance's (lease lost or taken over)")]
    Fenced(i16),
    #[error("joining the consumer group failed")]
    Group(#[source] GroupError),
    #[error("a handled message of the batch was left without a fate; the batch is redelivered")]
    Undecided,
}

/// Errors of an ordered consumer's group (see [`crate::ordered`]).
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error(
        "consumer {consumer:?} has {existing} partitions, this instance is configured with {configured}: \
         every instance of an ordered consumer must use the same count"
    )]
    PartitionCount {
        consumer: String,
        existing: u16,
        configured: u16,
    },
    #[error("database error")]
    Db(#[from] sqlx::Error),
}

/// Errors of an operator's action on an ordered consumer's aggregate.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("the aggregate has no position for this consumer")]
    NoSuchAggregate,
    #[error("the aggregate is not parked")]
    NotParked,
    #[error("the aggregate moved on since position {seen} was seen (now {now})")]
    Moved { seen: i64, now: i64 },
    #[error("nothing to skip: no message is held at the head and no gap is before the held ones")]
    NothingHeld,
    #[error("the broker did not accept the dead letter of message {0}")]
    DeadLetterRefused(uuid::Uuid),
    #[error("RabbitMQ operation failed")]
    Amqp(#[from] lapin::Error),
    #[error("database error")]
    Db(#[from] sqlx::Error),
}

/// Errors of the dead-letter commands (`consumer dlq list|replay`).
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error("cannot connect to RabbitMQ")]
    Connect(#[from] plumbing::amqp::AmqpError),
    #[error("dead-letter queue {queue} not found (has consumer {consumer:?} ever run?)")]
    NoDeadLetterQueue {
        queue: String,
        consumer: String,
        #[source]
        source: lapin::Error,
    },
    #[error("consumer queue {queue} not found, cannot replay into it")]
    NoQueue {
        queue: String,
        #[source]
        source: lapin::Error,
    },
    #[error("RabbitMQ operation failed")]
    Amqp(#[from] lapin::Error),
    #[error("the broker did not accept the replayed message {0}")]
    NotConfirmed(String),
    #[error(
        "consumer {consumer:?} is an ordered consumer (its exchange {exchange} exists): replay refused. \
         A replayed copy would go to its queue {consumer}, which it does not consume, and even if \
         routed to its partitions it would arrive after its aggregate's position passed it and be \
         dropped as stale. To have the effect applied, publish a new event from the producer (it \
         takes the aggregate's next number); for an aggregate that is parked or waiting, use the \
         ordered admin actions (retry the head, or skip it). If the consumer is no longer \
         ordered, delete exchange {exchange} first"
    )]
    Ordered { consumer: String, exchange: String },
    #[error("{0} timed out after {1:?}")]
    Timeout(&'static str, Duration),
}
