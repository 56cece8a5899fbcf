//! An ordered consumer's routing: its own headers exchange splits the outbox traffic over its
//! partition queues by the relay's `aggregate_partition` header, so all of one aggregate's
//! messages land in one queue, in the order the relay published them.
//!
//! ```text
//! outbox exchange --"#"--> NAME.ordered (headers) --aggregate_partition = p, p mod N = k
//!                                                  [, aggregate_type = T]--> NAME.ordered.k
//! ```
//!
//! Partition queues are quorum queues with single active consumer: besides the lease (see
//! [`super::group`]), the broker itself delivers a queue to one consumer at a time.

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Connection, ExchangeKind};
use plumbing::amqp::headers as h;

/// The relay's partitions (`messages.partition`, 0..63).
pub const RELAY_PARTITIONS: i16 = 64;

/// The headers exchange of consumer `name`: `NAME.ordered`.
pub fn exchange(name: &str) -> String {
    format!("{name}.ordered")
}

/// Partition queue `k` of consumer `name`: `NAME.ordered.k`.
pub fn queue(name: &str, k: i16) -> String {
    format!("{name}.ordered.{k}")
}

/// Every queue and exchange of the ordered routing (for operators and test cleanup).
pub fn names(name: &str, partitions: u16) -> (Vec<String>, Vec<String>) {
    let queues = (0..partitions as i16).map(|k| queue(name, k)).collect();
    (queues, vec![exchange(name)])
}

/// The consumer partition a relay partition goes to.
pub fn partition_of(relay_partition: i16, partitions: u16) -> i16 {
    relay_partition.rem_euclid(partitions as i16)
}

/// Declares the headers exchange, its binding to the outbox exchange and the partition queues
/// with their bindings (idempotent). `aggregate_types`: whole aggregate types to receive (`#`:
/// all of them).
pub async fn declare(
    conn: &Connection,
    outbox_exchange: &str,
    name: &str,
    partitions: u16,
    aggregate_types: &[String],
) -> Result<(), lapin::Error> {
    let ch = conn.create_channel().await?;
    let ordered = exchange(name);
    ch.exchange_declare(
        ordered.as_str().into(),
        ExchangeKind::Headers,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.exchange_bind(
        ordered.as_str().into(),
        outbox_exchange.into(),
        "#".into(),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let all = aggregate_types.iter().any(|t| t == "#");
    for k in 0..partitions as i16 {
        let q = queue(name, k);
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
        for p in (0..RELAY_PARTITIONS).filter(|p| partition_of(*p, partitions) == k) {
            let types: Vec<Option<&str>> = if all {
                vec![None]
            } else {
                aggregate_types.iter().map(|t| Some(t.as_str())).collect()
            };
            for t in types {
                ch.queue_bind(
                    q.as_str().into(),
                    ordered.as_str().into(),
                    "".into(),
                    QueueBindOptions::default(),
                    binding(p, t),
                )
                .await?;
            }
        }
    }
    let _ = ch.close(200, ShortString::from("declared")).await;
    Ok(())
}

/// `x-match: all` on the relay partition (and the aggregate type when given).
fn binding(relay_partition: i16, aggregate_type: Option<&str>) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-match".into(), text("all"));
    args.insert(
        h::AGGREGATE_PARTITION.into(),
        AMQPValue::LongLongInt(i64::from(relay_partition)),
    );
    if let Some(t) = aggregate_type {
        args.insert(h::AGGREGATE_TYPE.into(), text(t));
    }
    args
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_relay_partition_goes_to_one_queue_and_the_spread_is_even() {
        for n in [1u16, 3, 8, 64] {
            let mut counts = vec![0; n as usize];
            for p in 0..RELAY_PARTITIONS {
                counts[partition_of(p, n) as usize] += 1;
            }
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(max - min <= 1, "{n}: {counts:?}");
        }
    }
}
