//! The statements on `consumer_positions` and `consumer_held`: set-based, a few per batch
//! whatever its size.

use shared::Envelope;
use shared::schema::Schema;
use sqlx::PgConnection;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;
use uuid::Uuid;

/// An aggregate, as its messages name it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AggregateKey {
    pub aggregate_type: String,
    pub aggregate_id: String,
}

impl AggregateKey {
    pub fn of(env: &Envelope) -> Self {
        Self {
            aggregate_type: env.aggregate_type.clone(),
            aggregate_id: env.aggregate_id.clone(),
        }
    }
}

/// An aggregate's position row, locked, and the numbers held for it.
#[derive(Debug, Clone, Default)]
pub struct Head {
    pub applied: i64,
    pub attempts: u32,
    /// Parked, or a retry whose time has not come.
    pub waits: bool,
    pub held: BTreeSet<i64>,
}

pub struct HeldRow {
    pub key: AggregateKey,
    pub seq: i64,
    pub env: Envelope,
}

pub struct PositionUpdate {
    pub key: AggregateKey,
    pub applied: i64,
    pub attempts: u32,
    /// A transient failure of the head: tried again after this.
    pub retry_in: Option<Duration>,
    pub park: bool,
    pub last_error: Option<String>,
}

fn split(keys: &[AggregateKey]) -> (Vec<&str>, Vec<&str>) {
    keys.iter()
        .map(|k| (k.aggregate_type.as_str(), k.aggregate_id.as_str()))
        .unzip()
}

/// The positions of `keys`, with the numbers held for each; rows missing (an aggregate's first
/// message) are created at 0 first. One statement once every aggregate has a row.
///
/// No row lock: a position changes only in a transaction that holds its partition, the owner's
/// apply (fence `FOR SHARE`, one at a time per partition) or an operator's action, which locks
/// the partition row `FOR UPDATE` (see [`lock_partition_of`]) and so waits for the apply in
/// flight and holds the next one back. A row lock per aggregate per batch would be a write per
/// aggregate for nothing.
pub async fn positions(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    partition: i16,
    keys: &[AggregateKey],
) -> Result<HashMap<AggregateKey, Head>, sqlx::Error> {
    let mut heads = existing(conn, schema, consumer, keys).await?;
    let missing: Vec<AggregateKey> = keys
        .iter()
        .filter(|k| !heads.contains_key(*k))
        .cloned()
        .collect();
    if !missing.is_empty() {
        let (types, ids) = split(&missing);
        sqlx::query(schema.sql(
            "INSERT INTO {{schema}}.consumer_positions (consumer, aggregate_type, aggregate_id, partition) \
             SELECT $1, t, i, $4 FROM unnest($2::text[], $3::text[]) AS u(t, i) \
             ON CONFLICT DO NOTHING",
        ))
        .bind(consumer)
        .bind(&types)
        .bind(&ids)
        .bind(partition)
        .execute(&mut *conn)
        .await?;
        heads.extend(existing(conn, schema, consumer, &missing).await?);
    }
    Ok(heads)
}

async fn existing(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    keys: &[AggregateKey],
) -> Result<HashMap<AggregateKey, Head>, sqlx::Error> {
    let (types, ids) = split(keys);
    let rows: Vec<(String, String, i64, i32, bool, Vec<i64>)> = sqlx::query_as(schema.sql(
        "SELECT p.aggregate_type, p.aggregate_id, p.applied_seq, p.attempts, \
                (p.parked_at IS NOT NULL OR coalesce(p.retry_at > now(), false)), \
                coalesce((SELECT array_agg(h.aggregate_seq) FROM {{schema}}.consumer_held h \
                          WHERE h.consumer = p.consumer AND h.aggregate_type = p.aggregate_type \
                            AND h.aggregate_id = p.aggregate_id), '{}') \
         FROM {{schema}}.consumer_positions p \
         JOIN unnest($2::text[], $3::text[]) AS u(t, i) ON p.aggregate_type = u.t AND p.aggregate_id = u.i \
         WHERE p.consumer = $1 \
         ORDER BY p.aggregate_type, p.aggregate_id",
    ))
    .bind(consumer)
    .bind(&types)
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(t, i, applied, attempts, waits, held)| {
            (
                AggregateKey {
                    aggregate_type: t,
                    aggregate_id: i,
                },
                Head {
                    applied,
                    attempts: attempts.max(0) as u32,
                    waits,
                    held: held.into_iter().collect(),
                },
            )
        })
        .collect())
}

/// The held envelopes whose turn came.
pub async fn held_envelopes(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    wanted: &[(AggregateKey, i64)],
) -> Result<BTreeMap<(AggregateKey, i64), Envelope>, sqlx::Error> {
    if wanted.is_empty() {
        return Ok(BTreeMap::new());
    }
    let types: Vec<&str> = wanted
        .iter()
        .map(|(k, _)| k.aggregate_type.as_str())
        .collect();
    let ids: Vec<&str> = wanted
        .iter()
        .map(|(k, _)| k.aggregate_id.as_str())
        .collect();
    let seqs: Vec<i64> = wanted.iter().map(|(_, s)| *s).collect();
    let rows: Vec<(String, String, i64, sqlx::types::Json<Envelope>)> = sqlx::query_as(schema.sql(
        "SELECT h.aggregate_type, h.aggregate_id, h.aggregate_seq, h.envelope \
         FROM {{schema}}.consumer_held h \
         JOIN unnest($2::text[], $3::text[], $4::int8[]) AS u(t, i, s) \
           ON h.aggregate_type = u.t AND h.aggregate_id = u.i AND h.aggregate_seq = u.s \
         WHERE h.consumer = $1",
    ))
    .bind(consumer)
    .bind(&types)
    .bind(&ids)
    .bind(&seqs)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(t, i, s, env)| {
            (
                (
                    AggregateKey {
                        aggregate_type: t,
                        aggregate_id: i,
                    },
                    s,
                ),
                env.0,
            )
        })
        .collect())
}

/// The transaction's writes: positions, newly held messages, released (applied) held ones.
pub async fn write(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    partition: i16,
    updates: &[PositionUpdate],
    hold: &[HeldRow],
    release: &[(AggregateKey, i64)],
) -> Result<(), sqlx::Error> {
    if !updates.is_empty() {
        let types: Vec<&str> = updates
            .iter()
            .map(|u| u.key.aggregate_type.as_str())
            .collect();
        let ids: Vec<&str> = updates
            .iter()
            .map(|u| u.key.aggregate_id.as_str())
            .collect();
        let applied: Vec<i64> = updates.iter().map(|u| u.applied).collect();
        let attempts: Vec<i32> = updates
            .iter()
            .map(|u| i32::try_from(u.attempts).unwrap_or(i32::MAX))
            .collect();
        let retry_secs: Vec<Option<f64>> = updates
            .iter()
            .map(|u| u.retry_in.map(|d| d.as_secs_f64()))
            .collect();
        let park: Vec<bool> = updates.iter().map(|u| u.park).collect();
        let errors: Vec<Option<&str>> = updates.iter().map(|u| u.last_error.as_deref()).collect();
        sqlx::query(schema.sql(
            "UPDATE {{schema}}.consumer_positions p SET \
                 applied_seq = u.applied, attempts = u.attempts, \
                 retry_at = now() + make_interval(secs => u.retry_secs), \
                 parked_at = CASE WHEN u.park THEN coalesce(p.parked_at, now()) END, \
                 last_error = u.last_error, updated_at = now() \
             FROM unnest($2::text[], $3::text[], $4::int8[], $5::int4[], $6::float8[], $7::bool[], $8::text[]) \
                 AS u(t, i, applied, attempts, retry_secs, park, last_error) \
             WHERE p.consumer = $1 AND p.aggregate_type = u.t AND p.aggregate_id = u.i",
        ))
        .bind(consumer)
        .bind(&types)
        .bind(&ids)
        .bind(&applied)
        .bind(&attempts)
        .bind(&retry_secs)
        .bind(&park)
        .bind(&errors)
        .execute(&mut *conn)
        .await?;
    }
    if !hold.is_empty() {
        let types: Vec<&str> = hold.iter().map(|h| h.key.aggregate_type.as_str()).collect();
        let ids: Vec<&str> = hold.iter().map(|h| h.key.aggregate_id.as_str()).collect();
        let seqs: Vec<i64> = hold.iter().map(|h| h.seq).collect();
        let message_ids: Vec<Uuid> = hold.iter().map(|h| h.env.message_id).collect();
        let envs: Vec<sqlx::types::Json<&Envelope>> =
            hold.iter().map(|h| sqlx::types::Json(&h.env)).collect();
        sqlx::query(schema.sql(
            "INSERT INTO {{schema}}.consumer_held \
                 (consumer, aggregate_type, aggregate_id, aggregate_seq, partition, message_id, envelope) \
             SELECT $1, t, i, s, $5, m, e \
             FROM unnest($2::text[], $3::text[], $4::int8[], $6::uuid[], $7::jsonb[]) AS u(t, i, s, m, e) \
             ON CONFLICT DO NOTHING",
        ))
        .bind(consumer)
        .bind(&types)
        .bind(&ids)
        .bind(&seqs)
        .bind(partition)
        .bind(&message_ids)
        .bind(&envs)
        .execute(&mut *conn)
        .await?;
    }
    if !release.is_empty() {
        let types: Vec<&str> = release
            .iter()
            .map(|(k, _)| k.aggregate_type.as_str())
            .collect();
        let ids: Vec<&str> = release
            .iter()
            .map(|(k, _)| k.aggregate_id.as_str())
            .collect();
        let seqs: Vec<i64> = release.iter().map(|(_, s)| *s).collect();
        sqlx::query(schema.sql(
            "DELETE FROM {{schema}}.consumer_held h \
             USING unnest($2::text[], $3::text[], $4::int8[]) AS u(t, i, s) \
             WHERE h.consumer = $1 AND h.aggregate_type = u.t AND h.aggregate_id = u.i AND h.aggregate_seq = u.s",
        ))
        .bind(consumer)
        .bind(&types)
        .bind(&ids)
        .bind(&seqs)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// Aggregates of `partition` whose next message is held and may go now (its predecessor was
/// applied, a retry's time came, or an operator released it).
pub async fn ready(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    partition: i16,
    limit: i64,
) -> Result<Vec<AggregateKey>, sqlx::Error> {
    let rows: Vec<(String, String)> = sqlx::query_as(schema.sql(
        "SELECT h.aggregate_type, h.aggregate_id \
         FROM {{schema}}.consumer_held h \
         JOIN {{schema}}.consumer_positions p \
           ON p.consumer = h.consumer AND p.aggregate_type = h.aggregate_type \
          AND p.aggregate_id = h.aggregate_id AND h.aggregate_seq = p.applied_seq + 1 \
         WHERE h.consumer = $1 AND h.partition = $2 \
           AND p.parked_at IS NULL AND (p.retry_at IS NULL OR p.retry_at <= now()) \
         ORDER BY h.aggregate_type, h.aggregate_id LIMIT $3",
    ))
    .bind(consumer)
    .bind(partition)
    .bind(limit)
    .persistent(false)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(t, i)| AggregateKey {
            aggregate_type: t,
            aggregate_id: i,
        })
        .collect())
}

/// An operator's action on aggregate `key`: locks its partition row `FOR UPDATE`, so no apply of
/// that partition runs until the action commits (applies lock it `FOR SHARE`, see
/// [`super::group::fence`]), then its position row. `None` when the aggregate has no position.
pub async fn lock_partition_of(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    key: &AggregateKey,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(schema.sql(
        "WITH part AS ( \
             SELECT c.partition FROM {{schema}}.consumer_partitions c \
             JOIN {{schema}}.consumer_positions p ON p.consumer = c.consumer AND p.partition = c.partition \
             WHERE p.consumer = $1 AND p.aggregate_type = $2 AND p.aggregate_id = $3 \
             FOR UPDATE OF c) \
         SELECT applied_seq FROM {{schema}}.consumer_positions \
         WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 \
           AND EXISTS (SELECT 1 FROM part) \
         FOR UPDATE",
    ))
    .bind(consumer)
    .bind(&key.aggregate_type)
    .bind(&key.aggregate_id)
    .persistent(false)
    .fetch_optional(&mut *conn)
    .await
}
