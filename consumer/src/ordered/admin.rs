//! What operators see and do about an ordered consumer's stuck aggregates.
//!
//! Stuck is one of two things:
//! - **parked**: the head failed for good (attempts ran out, or a permanent failure); it and
//!   everything after it are held until an operator acts;
//! - **waiting for a gap**: the next message has not arrived (it is still on its way, dead in the
//!   outbox, or was dead-lettered as undecodable) for longer than the gap timeout. It is reported,
//!   never guessed: the aggregate waits.
//!
//! The actions, each one transaction that locks the aggregate's partition (no apply of it runs
//! meanwhile) and its position:
//! - [`retry_head`]: a parked aggregate's head is tried again now (attempts reset);
//! - [`dead_letter`] with [`Discard::Head`] (skip): the head is dead-lettered (published to `NAME.dlx` with its reason, confirmed,
//!   before the position moves past it) and the rest is released in order; for a gap, the missing
//!   number is passed over;
//! - [`dead_letter`] with [`Discard::Run`]: the head and everything held after it are
//!   dead-lettered; the position moves past the last of them.
//!
//! The console calls these with its audit and four-eyes rules (the skip and the dead-lettering
//! discard effects, so they need a second person).

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
use sqlx::PgPool;
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

/// What an action did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Resolved {
    /// Sequence numbers dead-lettered (empty for a retry, or a skipped gap).
    pub dead_lettered: Vec<i64>,
    /// The applied position after the action.
    pub applied_seq: i64,
}

/// A parked aggregate's head is tried again at once, with its attempts reset.
pub async fn retry_head(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    key: &AggregateKey,
) -> Result<Resolved, AdminError> {
    let mut tx = pool.begin().await?;
    store::lock_partition_of(&mut tx, schema, consumer, key)
        .await?
        .ok_or(AdminError::NoSuchAggregate)?;
    let applied: Option<i64> = sqlx::query_scalar(schema.sql(
        "UPDATE {{schema}}.consumer_positions \
         SET parked_at = NULL, retry_at = NULL, attempts = 0, updated_at = now() \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND parked_at IS NOT NULL \
         RETURNING applied_seq",
    ))
    .bind(consumer)
    .bind(&key.aggregate_type)
    .bind(&key.aggregate_id)
    .persistent(false)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    let applied_seq = applied.ok_or(AdminError::NotParked)?;
    Ok(Resolved {
        dead_lettered: Vec::new(),
        applied_seq,
    })
}

/// What [`dead_letter`] discards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Discard {
    /// Skip the head: it is dead-lettered (or, missing, passed over) and the rest is released in
    /// order.
    Head,
    /// The head and everything held after it are dead-lettered.
    Run,
}

/// Dead-letters what `discard` names, then moves the position past it (see the module docs).
pub async fn dead_letter(
    pool: &PgPool,
    schema: &Schema,
    channel: &lapin::Channel,
    consumer: &str,
    key: &AggregateKey,
    reason: &str,
    discard: Discard,
) -> Result<Resolved, AdminError> {
    let mut tx = pool.begin().await?;
    // No apply of the aggregate's partition runs until this commits.
    let position = store::lock_partition_of(&mut tx, schema, consumer, key).await?;
    let applied = position.ok_or(AdminError::NoSuchAggregate)?;
    let held: Vec<(i64, sqlx::types::Json<Envelope>)> = sqlx::query_as(schema.sql(
        "SELECT aggregate_seq, envelope FROM {{schema}}.consumer_held \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 ORDER BY aggregate_seq",
    ))
    .bind(consumer)
    .bind(&key.aggregate_type)
    .bind(&key.aggregate_id)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    let head = applied + 1;
    let doomed: Vec<&(i64, sqlx::types::Json<Envelope>)> = if discard == Discard::Run {
        held.iter().collect()
    } else {
        held.iter().filter(|(s, _)| *s == head).collect()
    };
    if doomed.is_empty() && held.first().is_none_or(|(s, _)| *s == head) {
        // Nothing to skip: no held head and no gap before the held ones.
        return Err(AdminError::NothingHeld);
    }
    // Dead letters first, confirmed; the position moves only after (a failure in between leaves
    // a dead letter of a message still held: a copy, never a loss).
    let dlx = format!("{consumer}.dlx");
    for (seq, env) in &doomed {
        publish_dead_letter(channel, consumer, &dlx, env, *seq, reason).await?;
    }
    let new_applied = match doomed.last() {
        Some((last, _)) => *last,
        None => head, // a gap: the missing number is passed over
    };
    let seqs: Vec<i64> = doomed.iter().map(|(s, _)| *s).collect();
    sqlx::query(schema.sql(
        "DELETE FROM {{schema}}.consumer_held \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND aggregate_seq = ANY($4)",
    ))
    .bind(consumer)
    .bind(&key.aggregate_type)
    .bind(&key.aggregate_id)
    .bind(&seqs)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.consumer_positions \
         SET applied_seq = $4, parked_at = NULL, retry_at = NULL, attempts = 0, last_error = NULL, \
             updated_at = now() \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3",
    ))
    .bind(consumer)
    .bind(&key.aggregate_type)
    .bind(&key.aggregate_id)
    .bind(new_applied)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Resolved {
        dead_lettered: seqs,
        applied_seq: new_applied,
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
