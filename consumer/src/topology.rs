//! The broker objects a consumer owns, named after the consumer, and their declaration.
//!
//! ```text
//!  outbox exchange (topic) --binding keys--> NAME (quorum queue) --reject--> NAME.dlx (fanout) --> NAME.dlq
//!                                              ^        |  transient failure: publish with x-attempt+1
//!                                              |        v
//!                     (TTL expired, dead-lettered back) NAME.retry.<delay>   (one queue per delay)
//! ```
//!
//! Retries wait in per-delay queues with `x-message-ttl` whose messages dead-letter back into the
//! main queue, so a failing message never spins in a hot requeue loop and a long delay does not
//! hold back a short one. Dead letters are published by the runtime to `NAME.dlx` with the reason
//! in headers; the main queue also dead-letters into it, so anything the broker rejects lands in the
//! same place. The dead-letter queue is declared a classic queue explicitly (`x-queue-type:
//! classic`), so that `dlq list` can browse it without counting deliveries even where the vhost's
//! default queue type is quorum (there, every browse would count as a failed delivery of each
//! letter, and the delivery limit, 20 by default on 4.x, would drop them).

use crate::config::format_duration;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ExchangeKind};
use std::time::Duration;

/// Names of a consumer's queues and exchanges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The durable quorum queue bound to the outbox exchange: `NAME`.
    pub queue: String,
    /// Fanout exchange dead letters go to: `NAME.dlx`.
    pub dead_letter_exchange: String,
    /// Durable queue keeping dead letters until replayed: `NAME.dlq`.
    pub dead_letter_queue: String,
    /// One queue per distinct retry delay: `NAME.retry.<delay>` (e.g. `ledger.retry.10s`).
    pub retry_queues: Vec<(Duration, String)>,
    /// A fair share's lanes (see [`crate::fair`]): quorum queues dead-lettering like the main
    /// queue, bound to nothing (the sorting workers publish to them by name).
    pub lanes: Vec<crate::fair::Lane>,
}

impl Topology {
    pub fn new(name: &str, retry_delays: &[Duration]) -> Self {
        let mut retry_queues: Vec<(Duration, String)> = Vec::new();
        for &d in retry_delays {
            if !retry_queues.iter().any(|(x, _)| *x == d) {
                retry_queues.push((d, format!("{name}.retry.{}", format_duration(d))));
            }
        }
        Self {
            queue: name.to_string(),
            dead_letter_exchange: format!("{name}.dlx"),
            dead_letter_queue: format!("{name}.dlq"),
            retry_queues,
            lanes: Vec::new(),
        }
    }

    /// Every queue of this consumer (for operators and test cleanup).
    pub fn queues(&self) -> Vec<String> {
        let mut q = vec![self.queue.clone(), self.dead_letter_queue.clone()];
        q.extend(self.retry_queues.iter().map(|(_, n)| n.clone()));
        q.extend(self.lanes.iter().map(|l| l.queue.clone()));
        q
    }

    /// Every exchange of this consumer (the outbox exchange is shared, not listed).
    pub fn exchanges(&self) -> Vec<String> {
        vec![self.dead_letter_exchange.clone()]
    }

    /// The retry queue that delays `delay`.
    pub fn retry_queue(&self, delay: Duration) -> Option<&str> {
        self.retry_queues
            .iter()
            .find(|(d, _)| *d == delay)
            .map(|(_, n)| n.as_str())
    }

    /// The retry queue of the shortest delay at least `wait` (the longest there is when none is
    /// that long): where a message waits for an unavailable remote.
    pub fn retry_queue_at_least(&self, wait: Duration) -> Option<&str> {
        self.retry_queues
            .iter()
            .filter(|(d, _)| *d >= wait)
            .min_by_key(|(d, _)| *d)
            .or_else(|| self.retry_queues.iter().max_by_key(|(d, _)| *d))
            .map(|(_, n)| n.as_str())
    }

    /// Declares everything (idempotent): the outbox exchange, the dead-letter exchange and queue,
    /// the main queue with `bindings`, and the retry queues.
    pub async fn declare(
        &self,
        conn: &Connection,
        exchange: &str,
        bindings: &[String],
    ) -> Result<(), lapin::Error> {
        plumbing::amqp::declare_outbox_exchange(conn, exchange, true).await?;
        let ch = conn.create_channel().await?;
        let ch = self.declare_dead_letters(conn, ch).await?;
        let mut ch = self.declare_queue(conn, ch, exchange, bindings).await?;
        for lane in &self.lanes {
            ch = self.declare_quorum(conn, ch, &lane.queue).await?;
        }
        let ch = self.declare_retry_queues(conn, ch).await?;
        let _ = ch.close(200, ShortString::from("declared")).await;
        Ok(())
    }

    /// The dead-letter exchange, and its queue bound to it; returns the channel to go on with (a
    /// new one if a declaration closed it).
    async fn declare_dead_letters(
        &self,
        conn: &Connection,
        mut ch: Channel,
    ) -> Result<Channel, lapin::Error> {
        ch.exchange_declare(
            self.dead_letter_exchange.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        if let Err(e) = self.declare_dead_letter_queue(conn, &mut ch).await {
            ch = on_node_down(conn, &self.dead_letter_queue, e).await?;
        }
        Ok(ch)
    }

    /// The dead-letter queue (a classic queue; one declared otherwise before is used as it is),
    /// bound to the dead-letter exchange.
    async fn declare_dead_letter_queue(
        &self,
        conn: &Connection,
        ch: &mut Channel,
    ) -> Result<(), lapin::Error> {
        if let Err(e) = ch
            .queue_declare(
                self.dead_letter_queue.as_str().into(),
                durable(),
                dead_letter_queue_arguments(),
            )
            .await
        {
            if !is_code(&e, 406) {
                return Err(e);
            }
            // Declared before without the type (RabbitMQ 3.10 holds an untyped classic queue
            // inequivalent to a typed one), or made a quorum queue by a vhost's default type.
            tracing::warn!(
                queue = %self.dead_letter_queue,
                error = %e,
                "dead-letter queue exists with other arguments; using it as it is (if it is a quorum queue, each `dlq list` counts as a failed delivery of every letter, and the delivery limit drops them: recreate it as a classic queue)"
            );
            *ch = conn.create_channel().await?;
            ch.queue_declare(
                self.dead_letter_queue.as_str().into(),
                passive(),
                FieldTable::default(),
            )
            .await?;
        }
        ch.queue_bind(
            self.dead_letter_queue.as_str().into(),
            self.dead_letter_exchange.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
    }

    /// A quorum queue dead-lettering to the dead-letter exchange (one declared otherwise before
    /// is used as it is): the main queue, a fair share's lane.
    async fn declare_quorum(
        &self,
        conn: &Connection,
        mut ch: Channel,
        queue: &str,
    ) -> Result<Channel, lapin::Error> {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert(
            "x-dead-letter-exchange".into(),
            text(&self.dead_letter_exchange),
        );
        args.insert(
            "x-quorum-initial-group-size".into(),
            AMQPValue::LongLongInt(QUORUM_INITIAL_GROUP_SIZE),
        );
        if let Err(e) = ch.queue_declare(queue.into(), durable(), args).await {
            // Declared before with other arguments (e.g. without a group size): use it as it is.
            if !is_code(&e, 406) {
                return Err(e);
            }
            tracing::warn!(queue = %queue, error = %e, "queue exists with other arguments; using it as it is");
            ch = conn.create_channel().await?;
            ch.queue_declare(queue.into(), passive(), FieldTable::default())
                .await?;
        }
        Ok(ch)
    }

    /// The main queue (a quorum queue dead-lettering to the dead-letter exchange; one declared
    /// otherwise before is used as it is), bound to `exchange` by `bindings`.
    async fn declare_queue(
        &self,
        conn: &Connection,
        ch: Channel,
        exchange: &str,
        bindings: &[String],
    ) -> Result<Channel, lapin::Error> {
        let ch = self.declare_quorum(conn, ch, &self.queue).await?;
        for key in bindings {
            ch.queue_bind(
                self.queue.as_str().into(),
                exchange.into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        }
        Ok(ch)
    }

    /// The retry queues: each holds a message for its delay, then dead-letters it back to the
    /// main queue.
    async fn declare_retry_queues(
        &self,
        conn: &Connection,
        mut ch: Channel,
    ) -> Result<Channel, lapin::Error> {
        for (delay, name) in &self.retry_queues {
            let mut args = FieldTable::default();
            let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
            args.insert("x-dead-letter-exchange".into(), text(""));
            args.insert("x-dead-letter-routing-key".into(), text(&self.queue));
            if let Err(e) = ch
                .queue_declare(name.as_str().into(), durable(), args)
                .await
            {
                ch = on_node_down(conn, name, e).await?;
            }
        }
        Ok(ch)
    }
}

/// A durable queue's declaration.
fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

/// A passive declaration: the queue as it exists.
fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions {
        passive: true,
        ..Default::default()
    }
}

/// The dead-letter queue's arguments: a classic queue by its own declaration, whatever the
/// vhost's default queue type (see the module docs).
pub fn dead_letter_queue_arguments() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), text("classic"));
    args
}

/// Members of a new consumer queue (a quorum queue): with 3, it keeps working, and loses
/// nothing confirmed, while any one of them is down. RabbitMQ places them on as many running
/// nodes as there are, up to this size (a single-node broker gets one member).
pub const QUORUM_INITIAL_GROUP_SIZE: i64 = 3;

/// The broker's reply code of a channel or connection error, if it is one.
fn is_code(e: &lapin::Error, code: u16) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == code)
}

/// A classic queue (dead letters, retry delays) lives on one node: while that node is down,
/// declaring it fails with NOT_FOUND ("home node ... is down"). The consumer does not wait for
/// it: it consumes its quorum queue on the nodes that are up; a retry or dead letter published
/// meanwhile is refused and the delivery is retried later. Returns a fresh channel.
async fn on_node_down(
    conn: &Connection,
    queue: &str,
    e: lapin::Error,
) -> Result<lapin::Channel, lapin::Error> {
    if !is_code(&e, 404) {
        return Err(e);
    }
    tracing::warn!(%queue, error = %e, "queue unavailable (its node is down); consuming without it");
    conn.create_channel().await
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_takes_the_shortest_retry_queue_at_least_as_long_or_else_the_longest() {
        let t = Topology::new(
            "c",
            &[
                Duration::from_secs(1),
                Duration::from_secs(10),
                Duration::from_secs(60),
            ],
        );
        let q = |secs: u64| t.retry_queue_at_least(Duration::from_secs(secs));
        assert_eq!(q(0), Some("c.retry.1s"));
        assert_eq!(q(2), Some("c.retry.10s"));
        assert_eq!(q(60), Some("c.retry.1m"));
        assert_eq!(q(3600), Some("c.retry.1m"), "longer than any: the longest");
        assert_eq!(
            Topology::new("c", &[]).retry_queue_at_least(Duration::ZERO),
            None
        );
    }

    #[test]
    fn names_derive_from_the_consumer() {
        let t = Topology::new(
            "ledger",
            &[
                Duration::from_millis(100),
                Duration::from_secs(5),
                Duration::from_millis(100),
            ],
        );
        assert_eq!(t.queue, "ledger");
        assert_eq!(t.dead_letter_exchange, "ledger.dlx");
        assert_eq!(t.dead_letter_queue, "ledger.dlq");
        assert_eq!(
            t.queues(),
            vec![
                "ledger",
                "ledger.dlq",
                "ledger.retry.100ms",
                "ledger.retry.5s"
            ]
        );
        assert_eq!(
            t.retry_queue(Duration::from_secs(5)),
            Some("ledger.retry.5s")
        );
    }

    #[test]
    fn the_dead_letter_queue_is_classic_by_declaration() {
        let args = dead_letter_queue_arguments();
        assert_eq!(args.inner().get("x-queue-type"), Some(&text("classic")));
    }
}
