//! The consumer group: which instance consumes which partition queue (`consumer_partitions`),
//! and the fence every apply transaction checks.
//!
//! As the relay shares its partitions: each instance heartbeats in `consumer_instances`, renews
//! the leases it holds and aims at its fair share ([`plumbing::membership::fair_share`], so the
//! spread is even to ±1): it takes free or expired partitions when it holds fewer and gives back
//! the surplus when it holds more. Taking a partition raises its `epoch`. An apply transaction
//! locks its partition row `FOR SHARE` and checks owner, epoch and lease: a takeover (an
//! `UPDATE` of that row) waits for the transactions in flight and every later one of the old
//! owner fails the check. A paused or cut-off instance cannot apply anything after losing it.

use crate::error::GroupError;
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use std::collections::BTreeMap;
use std::time::Duration;

/// A held partition: the queue's number and the epoch this instance took it at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub partition: i16,
    pub epoch: i64,
}

/// The partitions after one heartbeat.
#[derive(Debug, Default)]
pub struct Held {
    /// Partition -> slot. There is no local view of the lease's end: the fence in every apply
    /// transaction checks the database's.
    pub slots: BTreeMap<i16, Slot>,
    /// How many partitions to give back (held beyond the fair share).
    pub surplus: usize,
}

/// Creates the group on first use; a later instance must name the same partition count.
pub async fn ensure(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    partitions: u16,
) -> Result<(), GroupError> {
    let mut tx = pool.begin().await?;
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.consumer_groups (consumer, partitions) VALUES ($1, $2) \
         ON CONFLICT (consumer) DO NOTHING",
    ))
    .bind(consumer)
    .bind(partitions as i16)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    let existing: i16 = sqlx::query_scalar(
        schema.sql("SELECT partitions FROM {{schema}}.consumer_groups WHERE consumer = $1"),
    )
    .bind(consumer)
    .persistent(false)
    .fetch_one(&mut *tx)
    .await?;
    if existing != partitions as i16 {
        return Err(GroupError::PartitionCount {
            consumer: consumer.to_string(),
            existing: existing as u16,
            configured: partitions,
        });
    }
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.consumer_partitions (consumer, partition) \
         SELECT $1, p FROM generate_series(0, $2 - 1) AS p ON CONFLICT DO NOTHING",
    ))
    .bind(consumer)
    .bind(i32::from(partitions))
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// One heartbeat: register, renew, take up to the fair share. Returns what is held after it.
pub async fn tick(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    instance: &str,
    partitions: u16,
    lease: Duration,
) -> Result<Held, sqlx::Error> {
    let secs = lease.as_secs_f64();
    let mut tx = pool.begin().await?;
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.consumer_instances (consumer, instance_id) VALUES ($1, $2) \
         ON CONFLICT (consumer, instance_id) DO UPDATE SET heartbeat_at = now()",
    ))
    .bind(consumer)
    .bind(instance)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    let live: Vec<String> = sqlx::query_scalar(schema.sql(
        "SELECT instance_id FROM {{schema}}.consumer_instances \
         WHERE consumer = $1 AND heartbeat_at > now() - make_interval(secs => $2) \
         ORDER BY instance_id",
    ))
    .bind(consumer)
    .bind(secs)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    let rank = live.iter().position(|i| i == instance).unwrap_or(0);
    let fair =
        plumbing::membership::fair_share(i64::from(partitions), live.len() as i64, rank as i64);
    let mut held: Vec<(i16, i64)> = sqlx::query_as(schema.sql(
        "UPDATE {{schema}}.consumer_partitions SET lease_until = now() + make_interval(secs => $3) \
         WHERE consumer = $1 AND owner = $2 AND lease_until > now() RETURNING partition, epoch",
    ))
    .bind(consumer)
    .bind(instance)
    .bind(secs)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    let missing = fair - held.len() as i64;
    if missing > 0 {
        let taken: Vec<(i16, i64)> = sqlx::query_as(schema.sql(
            "UPDATE {{schema}}.consumer_partitions \
             SET owner = $2, epoch = epoch + 1, lease_until = now() + make_interval(secs => $3) \
             WHERE consumer = $1 AND partition IN ( \
                 SELECT partition FROM {{schema}}.consumer_partitions \
                 WHERE consumer = $1 AND (owner IS NULL OR lease_until < now()) \
                 ORDER BY partition LIMIT $4 FOR UPDATE SKIP LOCKED) \
             RETURNING partition, epoch",
        ))
        .bind(consumer)
        .bind(instance)
        .bind(secs)
        .bind(missing)
        .persistent(false)
        .fetch_all(&mut *tx)
        .await?;
        held.extend(taken);
    }
    sqlx::query(schema.sql(
        "DELETE FROM {{schema}}.consumer_instances \
         WHERE consumer = $1 AND heartbeat_at < now() - make_interval(secs => $2 * 10)",
    ))
    .bind(consumer)
    .bind(secs)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Held {
        surplus: (held.len() as i64 - fair).max(0) as usize,
        slots: held
            .into_iter()
            .map(|(partition, epoch)| (partition, Slot { partition, epoch }))
            .collect(),
    })
}

/// Gives partitions back (surplus, or all at shutdown) so another instance takes them at once.
/// Only after their workers stopped: nothing of theirs is in flight.
pub async fn release(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    instance: &str,
    partitions: &[i16],
) -> Result<(), sqlx::Error> {
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.consumer_partitions SET owner = NULL, lease_until = '-infinity' \
         WHERE consumer = $1 AND owner = $2 AND partition = ANY($3)",
    ))
    .bind(consumer)
    .bind(instance)
    .bind(partitions)
    .persistent(false)
    .execute(pool)
    .await?;
    Ok(())
}

/// Leaves the group (at shutdown, after [`release`]).
pub async fn leave(
    pool: &PgPool,
    schema: &Schema,
    consumer: &str,
    instance: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        schema.sql(
            "DELETE FROM {{schema}}.consumer_instances WHERE consumer = $1 AND instance_id = $2",
        ),
    )
    .bind(consumer)
    .bind(instance)
    .persistent(false)
    .execute(pool)
    .await?;
    Ok(())
}

/// The fence, first statement of every apply transaction: locks the partition row `FOR SHARE`
/// (a takeover waits for this transaction) and checks that this instance still holds it, at the
/// same epoch, with a lease the database's clock has not seen end.
pub async fn fence(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    instance: &str,
    slot: Slot,
) -> Result<bool, sqlx::Error> {
    let held: Option<i32> = sqlx::query_scalar(schema.sql(
        "SELECT 1 FROM {{schema}}.consumer_partitions \
         WHERE consumer = $1 AND partition = $2 AND owner = $3 AND epoch = $4 AND lease_until > now() \
         FOR SHARE",
    ))
    .bind(consumer)
    .bind(slot.partition)
    .bind(instance)
    .bind(slot.epoch)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(held.is_some())
}
