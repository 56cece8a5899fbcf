//! What operators see and do about an ordered consumer's stuck aggregates.
//!
//! Stuck is one of two things:
//! - **parked**: the head failed for good (attempts ran out, or a permanent failure); it and
//!   everything after it are held until an operator acts;
//! - **waiting for a gap**: the next message has not arrived (it is still on its way, dead in the
//!   outbox, or was dead-lettered as undecodable) for longer than the gap timeout. It is reported,
//!   never guessed: the aggregate waits.
//!
//! The actions run on the caller's connection, in its transaction (the console commits its audit
//! entry with the effect); each locks the aggregate's partition (no apply of it runs until the
//! caller commits) and its position, and checks the position the operator saw ([`Target::seen`]):
//! - [`retry_head`]: a parked aggregate's head is tried again now (attempts reset);
//! - [`dead_letter`] with [`Discard::Head`] (skip): the head is dead-lettered (published to
//!   `NAME.dlx` with its reason, confirmed, before the position moves past it) and the rest is
//!   released in order; for a gap, the missing number is passed over;
//! - [`dead_letter`] with [`Discard::Run`]: the head and everything held after it are
//!   dead-lettered; the position moves past the last of them.
//!
//! [`preview`] says what a discard would do without doing it. The console calls these with its
//! audit and four-eyes rules (the skip and the dead-lettering discard effects, so they need a
//! second person).

use super::store::{self, AggregateKey};
use crate::error::AdminError;
use crate::message::{self, headers as h};
use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use lapin::types::{FieldTable, ShortString};
use plumbing::amqp::headers as rh;
use serde::Serialize;
use shared::Envelope;
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use std::time::Duration;

/// Longest wait for the broker's confirm of a dead letter (the aggregate's partition waits
/// meanwhile).
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Why an aggregate is stuck.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StuckKind {
    Parked,
    Gap,
}

/// A stuck aggregate, as the console and the metric see it.
#[derive(Debug, Clone, Serialize)]
pub struct Stuck {
    pub kind: StuckKind,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// Last applied sequence number; the head is `applied_seq + 1`.
    pub applied_seq: i64,
    /// The head message, when it is held (a parked head always is; a gap's head is missing).
    pub head_message_id: Option<uuid::Uuid>,
    pub reason: Option<String>,
    pub attempts: i32,
    /// Messages held behind the head (the head included when held).
    pub held: i64,
    /// Since when: parked at, or the oldest held message's arrival for a gap.
    pub since: DateTime<Utc>,
}

/// Parked aggregates, then those waiting for a gap longer than `gap_timeout`, oldest first.
pub async fn stuck(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    gap_timeout: Duration,
    limit: i64,
) -> Result<Vec<Stuck>, sqlx::Error> {
    type Row = (
        bool,
        String,
        String,
        i64,
        Option<uuid::Uuid>,
        Option<String>,
        i32,
        i64,
        DateTime<Utc>,
    );
    let rows: Vec<Row> = sqlx::query_as(schema.sql(
        "WITH h AS ( \
             SELECT aggregate_type, aggregate_id, count(*) AS held, min(held_at) AS oldest, \
                    min(aggregate_seq) AS first_seq \
             FROM {{schema}}.consumer_held WHERE consumer = $1 \
             GROUP BY aggregate_type, aggregate_id) \
         SELECT p.parked_at IS NOT NULL, p.aggregate_type, p.aggregate_id, p.applied_seq, \
                (SELECT x.message_id FROM {{schema}}.consumer_held x WHERE x.consumer = p.consumer \
                   AND x.aggregate_type = p.aggregate_type AND x.aggregate_id = p.aggregate_id \
                   AND x.aggregate_seq = p.applied_seq + 1), \
                p.last_error, p.attempts, coalesce(h.held, 0), coalesce(p.parked_at, h.oldest) \
         FROM {{schema}}.consumer_positions p JOIN h USING (aggregate_type, aggregate_id) \
         WHERE p.consumer = $1 AND ( \
               p.parked_at IS NOT NULL \
            OR (p.retry_at IS NULL AND h.first_seq > p.applied_seq + 1 \
                AND h.oldest < now() - make_interval(secs => $2))) \
         ORDER BY p.parked_at IS NULL, coalesce(p.parked_at, h.oldest) LIMIT $3",
    ))
    .bind(consumer)
    .bind(gap_timeout.as_secs_f64())
    .bind(limit)
    .persistent(false)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(
                parked,
                aggregate_type,
                aggregate_id,
                applied_seq,
                head,
                reason,
                attempts,
                held,
                since,
            )| Stuck {
                kind: if parked {
                    StuckKind::Parked
                } else {
                    StuckKind::Gap
                },
                aggregate_type,
                aggregate_id,
                applied_seq,
                head_message_id: head,
                reason,
                attempts,
                held,
                since,
            },
        )
        .collect())
}

/// Counts for the gauges: parked aggregates, gap waits past the timeout, held messages.
pub async fn counts(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    gap_timeout: Duration,
) -> Result<(i64, i64, i64), sqlx::Error> {
    sqlx::query_as(schema.sql(
        "SELECT \
           (SELECT count(*) FROM {{schema}}.consumer_positions WHERE consumer = $1 AND parked_at IS NOT NULL), \
           (SELECT count(*) FROM ( \
               SELECT 1 FROM {{schema}}.consumer_held h JOIN {{schema}}.consumer_positions p \
                 USING (consumer, aggregate_type, aggregate_id) \
               WHERE h.consumer = $1 AND p.parked_at IS NULL AND p.retry_at IS NULL \
               GROUP BY h.aggregate_type, h.aggregate_id, p.applied_seq \
               HAVING min(h.aggregate_seq) > p.applied_seq + 1 \
                  AND min(h.held_at) < now() - make_interval(secs => $2)) g), \
           (SELECT count(*) FROM {{schema}}.consumer_held WHERE consumer = $1)",
    ))
    .bind(consumer)
    .bind(gap_timeout.as_secs_f64())
    .persistent(false)
    .fetch_one(pool)
    .await
}

/// Who holds a partition of an ordered consumer.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionOwner {
    pub partition: i16,
    /// The instance holding the lease (none when it was given up or never taken).
    pub owner: Option<String>,
    /// Raised at every change of hands (the fence).
    pub epoch: i64,
    pub lease_until: DateTime<Utc>,
    /// Whether the lease is current (database clock).
    pub live: bool,
    /// Aggregates of this partition with a position, and messages held in it.
    pub aggregates: i64,
    pub held: i64,
}

/// The partitions of `consumer`, in order.
pub async fn partitions(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
) -> Result<Vec<PartitionOwner>, sqlx::Error> {
    type Row = (i16, Option<String>, i64, DateTime<Utc>, bool, i64, i64);
    let rows: Vec<Row> = sqlx::query_as(schema.sql(
        "SELECT c.partition, c.owner, c.epoch, c.lease_until, c.owner IS NOT NULL AND c.lease_until > now(), \
                (SELECT count(*) FROM {{schema}}.consumer_positions p \
                  WHERE p.consumer = c.consumer AND p.partition = c.partition), \
                (SELECT count(*) FROM {{schema}}.consumer_held h \
                  WHERE h.consumer = c.consumer AND h.partition = c.partition) \
         FROM {{schema}}.consumer_partitions c WHERE c.consumer = $1 ORDER BY c.partition",
    ))
    .bind(consumer)
    .persistent(false)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(partition, owner, epoch, lease_until, live, aggregates, held)| PartitionOwner {
                partition,
                owner,
                epoch,
                lease_until,
                live,
                aggregates,
                held,
            },
        )
        .collect())
}

/// A message held for an aggregate, as an operator inspects it before deciding.
#[derive(Debug, Clone, Serialize)]
pub struct Held {
    pub aggregate_seq: i64,
    pub message_id: uuid::Uuid,
    pub event_type: String,
    pub payload: serde_json::Value,
    pub held_at: DateTime<Utc>,
}

/// The first `limit` messages held for aggregate `key` of `consumer`, in order; with `only`,
/// just those of these sequence numbers (what a discard would dead-letter). On a pool, or on the
/// caller's transaction.
pub async fn held<'e>(
    db: impl sqlx::PgExecutor<'e>,
    schema: &Schema,
    consumer: &str,
    key: &AggregateKey,
    only: Option<&[i64]>,
    limit: i64,
) -> Result<Vec<Held>, sqlx::Error> {
    let rows: Vec<(i64, sqlx::types::Json<Envelope>, DateTime<Utc>)> = sqlx::query_as(schema.sql(
        "SELECT aggregate_seq, envelope, held_at FROM {{schema}}.consumer_held \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 \
           AND ($4::bigint[] IS NULL OR aggregate_seq = ANY($4)) \
         ORDER BY aggregate_seq LIMIT $5",
    ))
    .bind(consumer)
    .bind(&key.aggregate_type)
    .bind(&key.aggregate_id)
    .bind(only)
    .bind(limit)
    .persistent(false)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(aggregate_seq, env, held_at)| {
            let env = env.0;
            Held {
                aggregate_seq,
                message_id: env.message_id,
                event_type: env.event_type,
                payload: env.payload,
                held_at,
            }
        })
        .collect())
}

/// What an action did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Resolved {
    /// Sequence numbers dead-lettered (empty for a retry, or a skipped gap).
    pub dead_lettered: Vec<i64>,
    /// The applied position after the action.
    pub applied_seq: i64,
}

/// What an operator acts on: one aggregate of one ordered consumer, and the applied position the
/// operator saw (`None`: whatever it is now). A position that moved since answers
/// [`AdminError::Moved`] and changes nothing: the operator decided on something that is no longer
/// there (four eyes: a request approved minutes later must still be about the same head).
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub consumer: &'a str,
    pub key: &'a AggregateKey,
    pub seen: Option<i64>,
}

/// Locks the target's partition and position (see [`store::lock_partition_of`]) and checks the
/// position seen; returns the applied position.
async fn lock(
    conn: &mut PgConnection,
    schema: &Schema,
    target: &Target<'_>,
) -> Result<i64, AdminError> {
    let applied = store::lock_partition_of(conn, schema, target.consumer, target.key)
        .await?
        .ok_or(AdminError::NoSuchAggregate)?;
    match target.seen {
        Some(seen) if seen != applied => Err(AdminError::Moved { seen, now: applied }),
        _ => Ok(applied),
    }
}

/// A parked aggregate's head is tried again at once, with its attempts reset. Runs on `conn`, in
/// the caller's transaction (the console commits its audit entry with it).
pub async fn retry_head(
    conn: &mut PgConnection,
    schema: &Schema,
    target: &Target<'_>,
) -> Result<Resolved, AdminError> {
    lock(conn, schema, target).await?;
    let applied: Option<i64> = sqlx::query_scalar(schema.sql(
        "UPDATE {{schema}}.consumer_positions \
         SET parked_at = NULL, retry_at = NULL, attempts = 0, updated_at = now() \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND parked_at IS NOT NULL \
         RETURNING applied_seq",
    ))
    .bind(target.consumer)
    .bind(&target.key.aggregate_type)
    .bind(&target.key.aggregate_id)
    .persistent(false)
    .fetch_optional(&mut *conn)
    .await?;
    let applied_seq = applied.ok_or(AdminError::NotParked)?;
    Ok(Resolved {
        dead_lettered: Vec::new(),
        applied_seq,
    })
}

/// What [`dead_letter`] discards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Discard {
    /// Skip the head: it is dead-lettered (or, missing, passed over) and the rest is released in
    /// order.
    Head,
    /// The head and everything held after it are dead-lettered.
    Run,
}

/// What a [`dead_letter`] would do, decided from the position and the held numbers alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiscardPlan {
    /// The sequence numbers that would be dead-lettered, in order.
    pub dead_letter: Vec<i64>,
    /// The applied position afterwards.
    pub applied_seq: i64,
}

/// The decision of [`dead_letter`]: `held` are the held numbers in order, `applied` the position.
/// Skipping a missing head passes the number over; skipping a held head dead-letters it; a run
/// takes every held number. Nothing held at the head and no gap: nothing to do.
pub fn plan_discard(
    applied: i64,
    held: &[i64],
    discard: Discard,
) -> Result<DiscardPlan, AdminError> {
    let head = applied + 1;
    let dead_letter: Vec<i64> = match discard {
        Discard::Run => held.to_vec(),
        Discard::Head => held.iter().copied().filter(|s| *s == head).collect(),
    };
    if dead_letter.is_empty() && held.first().is_none_or(|s| *s == head) {
        return Err(AdminError::NothingHeld);
    }
    let applied_seq = dead_letter.last().copied().unwrap_or(head);
    Ok(DiscardPlan {
        dead_letter,
        applied_seq,
    })
}

async fn held_of(
    conn: &mut PgConnection,
    schema: &Schema,
    target: &Target<'_>,
) -> Result<Vec<(i64, sqlx::types::Json<Envelope>)>, sqlx::Error> {
    sqlx::query_as(schema.sql(
        "SELECT aggregate_seq, envelope FROM {{schema}}.consumer_held \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 ORDER BY aggregate_seq",
    ))
    .bind(target.consumer)
    .bind(&target.key.aggregate_type)
    .bind(&target.key.aggregate_id)
    .persistent(false)
    .fetch_all(&mut *conn)
    .await
}

/// What [`dead_letter`] would do now, without doing it (the console's dry run, and its check
/// before it records a request for a second person). Locks like the action, on `conn`.
pub async fn preview(
    conn: &mut PgConnection,
    schema: &Schema,
    target: &Target<'_>,
    discard: Discard,
) -> Result<DiscardPlan, AdminError> {
    let applied = lock(conn, schema, target).await?;
    let held: Vec<i64> = held_of(conn, schema, target)
        .await?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    plan_discard(applied, &held, discard)
}

/// Dead-letters what `discard` names, then moves the position past it (see the module docs). Runs
/// on `conn`, in the caller's transaction: the dead letters are confirmed by the broker before it
/// returns, the position moves when the caller commits (a failure in between leaves a dead letter
/// of a message still held: a copy, never a loss).
pub async fn dead_letter(
    conn: &mut PgConnection,
    schema: &Schema,
    channel: &lapin::Channel,
    target: &Target<'_>,
    reason: &str,
    discard: Discard,
) -> Result<Resolved, AdminError> {
    // No apply of the aggregate's partition runs until the caller commits.
    let applied = lock(conn, schema, target).await?;
    let held = held_of(conn, schema, target).await?;
    let numbers: Vec<i64> = held.iter().map(|(s, _)| *s).collect();
    let plan = plan_discard(applied, &numbers, discard)?;
    let dlx = format!("{}.dlx", target.consumer);
    for (seq, env) in held.iter().filter(|(s, _)| plan.dead_letter.contains(s)) {
        publish_dead_letter(channel, target.consumer, &dlx, env, *seq, reason).await?;
    }
    sqlx::query(schema.sql(
        "DELETE FROM {{schema}}.consumer_held \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_seq = ANY($4)",
    ))
    .bind(target.consumer)
    .bind(&target.key.aggregate_type)
    .bind(&target.key.aggregate_id)
    .bind(&plan.dead_letter)
    .persistent(false)
    .execute(&mut *conn)
    .await?;
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.consumer_positions \
         SET applied_seq = $4, parked_at = NULL, retry_at = NULL, attempts = 0, last_error = NULL, \
             updated_at = now() \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3",
    ))
    .bind(target.consumer)
    .bind(&target.key.aggregate_type)
    .bind(&target.key.aggregate_id)
    .bind(plan.applied_seq)
    .persistent(false)
    .execute(&mut *conn)
    .await?;
    Ok(Resolved {
        dead_lettered: plan.dead_letter,
        applied_seq: plan.applied_seq,
    })
}

/// Publishes `env` (number `seq`) as a dead letter of `consumer`, as the runtime writes them
/// (`consumer dlq list` shows it, with kind `operator` and the reason), and waits for the confirm.
async fn publish_dead_letter(
    channel: &lapin::Channel,
    consumer: &str,
    exchange: &str,
    env: &Envelope,
    seq: i64,
    reason: &str,
) -> Result<(), AdminError> {
    let mut table = FieldTable::default();
    if let Err(e) = plumbing::amqp::json_to_headers(&env.headers, &mut table) {
        tracing::warn!(message_id = %env.message_id, error = %e, "dead letter without some of the message's headers");
    }
    message::set_text(&mut table, rh::AGGREGATE_TYPE, &env.aggregate_type);
    message::set_text(&mut table, rh::AGGREGATE_ID, &env.aggregate_id);
    message::set_int(&mut table, rh::AGGREGATE_SEQ, seq);
    message::set_text(&mut table, h::ORIGINAL_ROUTING_KEY, &env.event_type);
    message::set_text(&mut table, h::DEAD_LETTER_KIND, "operator");
    message::set_text(
        &mut table,
        h::DEAD_LETTER_REASON,
        &message::truncate(reason, 2000),
    );
    message::set_text(&mut table, h::DEAD_LETTERED_AT, &Utc::now().to_rfc3339());
    message::set_text(&mut table, h::DEAD_LETTER_CONSUMER, consumer);
    let properties = BasicProperties::default()
        .with_message_id(ShortString::from(env.message_id.to_string()))
        .with_type(ShortString::from(env.event_type.as_str()))
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(table);
    let body = serde_json::to_vec(&env.payload).unwrap_or_default();
    let confirm = channel
        .basic_publish(
            exchange.into(),
            env.event_type.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &body,
            properties,
        )
        .await?;
    let confirm = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
        .await
        .map_err(|_| AdminError::DeadLetterRefused(env.message_id))??;
    if !confirm.is_ack() || confirm.take_message().is_some() {
        return Err(AdminError::DeadLetterRefused(env.message_id));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipping_a_held_head_dead_letters_it_and_releases_the_rest() {
        let plan = plan_discard(4, &[5, 6, 7], Discard::Head).unwrap();
        assert_eq!(plan.dead_letter, vec![5]);
        assert_eq!(plan.applied_seq, 5);
    }

    #[test]
    fn skipping_a_missing_head_passes_its_number_over() {
        let plan = plan_discard(4, &[6, 7], Discard::Head).unwrap();
        assert!(plan.dead_letter.is_empty());
        assert_eq!(plan.applied_seq, 5);
    }

    #[test]
    fn a_run_dead_letters_everything_held() {
        let plan = plan_discard(4, &[5, 6, 9], Discard::Run).unwrap();
        assert_eq!(plan.dead_letter, vec![5, 6, 9]);
        assert_eq!(plan.applied_seq, 9);
        // Behind a gap, the run still takes what is held and moves past its last.
        let plan = plan_discard(4, &[7, 8], Discard::Run).unwrap();
        assert_eq!((plan.dead_letter, plan.applied_seq), (vec![7, 8], 8));
    }

    #[test]
    fn nothing_held_and_no_gap_is_nothing_to_do() {
        assert!(matches!(
            plan_discard(4, &[], Discard::Head),
            Err(AdminError::NothingHeld)
        ));
        assert!(matches!(
            plan_discard(4, &[], Discard::Run),
            Err(AdminError::NothingHeld)
        ));
    }
}
