//! Headers RabbitMQ owns, and why the consumer's copies leave them behind.
//!
//! The broker writes these itself: `x-death` (and, since 3.13, `x-first-death-*` and
//! `x-last-death-*`) when it dead-letters a message, `x-delivery-count` (quorum queues) and
//! `x-acquired-count` (4.x) when it delivers one again. A retry copy, a dead letter or a replay
//! the runtime publishes is a *new* message as far as the broker is concerned, and must not
//! carry them:
//!
//! - On 3.x, dead-lettering consults `x-death` for cycles: a message whose `x-death` says it left
//!   queue Q by dead-lettering, with no rejection since, is **dropped silently** (logged only) when
//!   it is dead-lettered into Q again. A dead letter the broker made for Q's delivery limit or TTL
//!   carries such an entry; replayed into Q with it and then retried (the retry queue's TTL
//!   dead-letters the copy back into Q), it is gone.
//! - On 4.x they are ignored on publish, but stale: a copy's `x-delivery-count` says nothing
//!   about the copy.
//!
//! The runtime keeps its own history in its own headers ([`crate::message::headers`]): the
//! attempt, the last error, the dead-letter kind and reason, when a letter was replayed and what
//! kind it was.

use lapin::types::FieldTable;

/// The broker-owned headers with fixed names.
pub const FIXED: [&str; 3] = ["x-death", "x-delivery-count", "x-acquired-count"];

/// The prefixes of the broker's summaries of `x-death` (3.13+: `-exchange`, `-queue`, `-reason`).
pub const PREFIXES: [&str; 2] = ["x-first-death-", "x-last-death-"];

/// Whether RabbitMQ owns header `name` (see the module docs). Header names are case-sensitive in
/// AMQP, and the broker writes these in lower case.
pub fn is_broker_owned(name: &str) -> bool {
    FIXED.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The broker's count of earlier failed deliveries of this message (`x-delivery-count`, quorum
/// queues; absent on a first delivery and on classic queues).
pub fn delivery_count(table: &FieldTable) -> Option<i64> {
    crate::message::header_int(table, "x-delivery-count")
}

/// Removes every broker-owned header from `table`.
pub fn strip(table: &mut FieldTable) {
    let mut kept = FieldTable::default();
    for (k, v) in table.inner().iter() {
        if !is_broker_owned(k.as_str()) {
            kept.insert(k.clone(), v.clone());
        }
    }
    *table = kept;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{self, headers};
    use lapin::types::{AMQPValue, FieldArray};

    #[test]
    fn only_the_brokers_headers_go() {
        let mut t = FieldTable::default();
        t.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::default()),
        );
        for name in [
            "x-first-death-exchange",
            "x-first-death-queue",
            "x-first-death-reason",
            "x-last-death-exchange",
            "x-last-death-queue",
            "x-last-death-reason",
        ] {
            message::set_text(&mut t, name, "q");
        }
        message::set_int(&mut t, "x-delivery-count", 3);
        message::set_int(&mut t, "x-acquired-count", 4);
        message::set_int(&mut t, headers::ATTEMPT, 2);
        message::set_text(&mut t, headers::REPLAYED_AT, "2026-12-02T15:00:00Z");
        message::set_text(&mut t, "traceparent", "00-a-b-01");
        message::set_text(&mut t, "x-deathly", "a producer's own");
        strip(&mut t);
        let mut names: Vec<&str> = t.inner().keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["traceparent", "x-attempt", "x-deathly", "x-replayed-at"]
        );
    }
}
