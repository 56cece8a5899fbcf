//! The relay's SQL, one small function per intent. No transaction is held open across a broker wait:
//! the claim is a plain read (partition ownership is the lock), the mark one statement.
//!
//! Every function runs its statements in an explicit transaction, as unnamed (not `persistent`)
//! statements: that is what works through PgBouncer in transaction pooling mode (before 1.21,
//! which cannot track named prepared statements), where a server connection is ours only from
//! `BEGIN` to `COMMIT` and sqlx's two round trips of one statement (parse, then execute) could
//! otherwise land on two different servers. On a direct connection it costs one round trip more
//! per statement and a `BEGIN`/`COMMIT` for single reads, small against batches of rows.
//!
//! The two statements the pipeline runs all the time, the claim and the mark, differ in two ways:
//! - On a direct session ([`Statements::Prepared`]) they are prepared once per connection. At
//!   1,000 commits a second the relay claims on almost every commit, and planning the claim anew
//!   each time cost more than running it (0.28 ms against 0.18 ms, pg_stat_statements with
//!   `track_planning`).
//! - They run with sequential and bitmap scans off ([`begin_indexed`]). An outbox's statistics are
//!   wrong most of the time: it is emptied as fast as it fills, and a backlog builds up between two
//!   ANALYZEs. Planned on a nearly empty table, the claim's per-partition read became a sequential
//!   scan, 64 of them per claim (1.2 ms instead of 0.2 ms at 1,000 msg/s); or a bitmap scan of the
//!   whole partition and a sort, kept as the prepared statement's plan once the backlog arrived
//!   (165 ms instead of 10 ms a claim at a 100,000-row backlog). The mark's `seq = ANY(...)` is a
//!   primary-key lookup either way, so turning both off changes nothing else.
//! - The claim reads a partition as the range `partition >= p AND partition < p + 1`, ordered by
//!   `(partition, seq)`: only `messages_claim_idx` can give that range in that order.
//!   Written as `partition = p ORDER BY seq`, the primary key gives the same order, and a plan made
//!   on a table the planner took for small walked it from the oldest row for each partition.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool, Row};
use std::time::Duration;
use uuid::Uuid;

/// How the pipeline's statements reach PostgreSQL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Statements {
    /// A direct session (or a pooler in session mode): the claim and the mark are prepared once
    /// per connection.
    Prepared,
    /// Through a transaction pooler: unnamed statements (the safe choice, and the default: a
    /// named statement prepared on one server connection is unknown on the next).
    #[default]
    Unnamed,
}

impl Statements {
    pub fn for_pooler(pooler: plumbing::db::Pooler) -> Self {
        match pooler {
            plumbing::db::Pooler::None => Statements::Prepared,
            plumbing::db::Pooler::Transaction => Statements::Unnamed,
        }
    }

    fn prepared(self) -> bool {
        self == Statements::Prepared
    }
}

/// Begins a transaction in which the planner does not use sequential scans (see the module
/// documentation), in the same round trip as the `BEGIN`; with `async_commit`, its commit does not
/// wait for the WAL flush either.
pub async fn begin_indexed(
    pool: &PgPool,
    async_commit: bool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    pool.begin_with(if async_commit {
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
         SET LOCAL synchronous_commit = off"
    } else {
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off"
    })
    .await
}

/// A claimed outbox row, ready to publish.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub seq: i64,
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// Position within the aggregate (1, 2, 3, ...), set by the outbox's trigger.
    pub aggregate_seq: i64,
    pub event_type: String,
    /// The payload as JSON text, sent as is.
    pub payload: String,
    pub headers: Map<String, Value>,
    pub created_at: DateTime<Utc>,
    pub attempts: i32,
    pub partition: i16,
}

/// What one claim asks for.
#[derive(Debug, Clone, Copy)]
pub struct ClaimArgs<'a> {
    /// Owned, unblocked partitions to claim from.
    pub partitions: &'a [i16],
    /// Rows at most from each partition (same order as `partitions`): a partition with one hot
    /// aggregate is asked for more.
    pub per_partition: &'a [i64],
    /// Where each partition's forward read starts (it takes seqs above it; same order).
    pub floors: &'a [i64],
    /// Rows at most in all (the lowest seqs, so every partition keeps a prefix).
    pub limit: i64,
    /// Rows this relay already holds (claimed, unsettled).
    pub held: &'a [i64],
    /// Transactions whose rows may have committed below the floors: these running ones...
    pub late_running: &'a [String],
    /// ... and every one from this id on (`None`: none yet).
    pub late_from: Option<&'a str>,
    pub statements: Statements,
}

/// The head of each owned, unblocked partition past its floor, in seq order, with the rows that
/// committed late below the floors (of the watched transactions), leaving out the rows this
/// relay already holds; and the snapshot taken just before (see `pipeline::positions`).
///
/// The late rows are read by transaction only (`OFFSET 0` keeps their subqueries apart, so the
/// planner cannot read them by partition and seq): through `messages_claim_idx` that would be the
/// partition's range from its start, every entry an old snapshot keeps.
///
/// The held rows are one array, turned into a hashed set once per statement (`NOT IN` over an
/// uncorrelated subquery), so the exclusion costs one probe per row looked at, also when thousands
/// of rows of one hot aggregate are in flight. Payloads are turned into text only for the rows
/// returned, not for every partition head looked at.
pub async fn claim(
    pool: &PgPool,
    schema: &Schema,
    owner: &str,
    args: &ClaimArgs<'_>,
) -> Result<(Vec<Claimed>, String), sqlx::Error> {
    let mut tx = begin_indexed(pool, false).await?;
    // Before the claim's own snapshot: every transaction the claim cannot see is running in this
    // one or starts after it.
    let snapshot: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .persistent(args.statements.prepared())
        .fetch_one(&mut *tx)
        .await?;
    let rows = claim_in(&mut tx, schema, owner, args).await?;
    tx.commit().await?;
    Ok((rows, snapshot))
}

/// [`claim`] on a connection inside a transaction begun by [`begin_indexed`].
pub async fn claim_in(
    conn: &mut PgConnection,
    schema: &Schema,
    owner: &str,
    args: &ClaimArgs<'_>,
) -> Result<Vec<Claimed>, sqlx::Error> {
    let sql = schema.sql(
        "SELECT c.seq, c.id, c.aggregate_type, c.aggregate_id, c.aggregate_seq, c.event_type, \
                c.payload::text AS payload, c.headers::text AS headers, \
                CASE WHEN isfinite(c.created_at) THEN c.created_at END AS created_at, \
                c.attempts, c.partition \
         FROM ( \
             SELECT DISTINCT ON (o.seq) o.* FROM ( \
                 SELECT o.* FROM unnest($1::smallint[], $3::bigint[], $6::bigint[]) AS l(p, n, f) \
                 JOIN {{schema}}.relay_partitions rp ON rp.partition = l.p \
                 CROSS JOIN LATERAL ( \
                     SELECT * FROM {{schema}}.messages o \
                     WHERE o.partition >= l.p AND o.partition < l.p + 1 \
                       AND o.state = 'pending' AND o.seq > l.f \
                       AND o.seq NOT IN (SELECT h.s FROM unnest($5::bigint[]) AS h(s)) \
                     ORDER BY o.partition, o.seq LIMIT l.n \
                 ) o \
                 WHERE rp.owner = $2 \
                   AND (rp.blocked_until IS NULL OR rp.blocked_until <= now()) \
                 UNION ALL \
                 SELECT o.* FROM ( \
                     SELECT * FROM {{schema}}.messages \
                     WHERE state = 'pending' AND txid = ANY($7::text[]::xid8[]) OFFSET 0) o \
                 JOIN unnest($1::smallint[], $6::bigint[]) AS l(p, f) ON l.p = o.partition \
                 JOIN {{schema}}.relay_partitions rp ON rp.partition = o.partition \
                 WHERE o.seq <= l.f \
                   AND o.seq NOT IN (SELECT h.s FROM unnest($5::bigint[]) AS h(s)) \
                   AND rp.owner = $2 \
                   AND (rp.blocked_until IS NULL OR rp.blocked_until <= now()) \
                 UNION ALL \
                 SELECT o.* FROM ( \
                     SELECT * FROM {{schema}}.messages \
                     WHERE state = 'pending' AND txid >= $8::text::xid8 OFFSET 0) o \
                 JOIN unnest($1::smallint[], $6::bigint[]) AS l(p, f) ON l.p = o.partition \
                 JOIN {{schema}}.relay_partitions rp ON rp.partition = o.partition \
                 WHERE o.seq <= l.f \
                   AND o.seq NOT IN (SELECT h.s FROM unnest($5::bigint[]) AS h(s)) \
                   AND rp.owner = $2 \
                   AND (rp.blocked_until IS NULL OR rp.blocked_until <= now()) \
             ) o \
             ORDER BY o.seq LIMIT $4 \
         ) c",
    );
    let query = sqlx::query(sql)
        .bind(args.partitions)
        .bind(owner)
        .bind(args.per_partition)
        .bind(args.limit)
        .bind(args.held)
        .bind(args.floors)
        .bind(args.late_running)
        .bind(args.late_from)
        .persistent(args.statements.prepared());
    let rows = query.fetch_all(conn).await?;
    rows.iter().map(decode_row).collect()
}

/// A claimed row, or one that cannot even be decoded (it is isolated by its seq, never allowed to
/// fail the whole claim).
#[derive(Debug, Clone)]
pub enum Claimed {
    Row(OutboxRow),
    Undecodable {
        seq: i64,
        partition: i16,
        reason: String,
    },
}

impl Claimed {
    pub fn partition(&self) -> i16 {
        match self {
            Claimed::Row(row) => row.partition,
            Claimed::Undecodable { partition, .. } => *partition,
        }
    }
    pub fn seq(&self) -> i64 {
        match self {
            Claimed::Row(row) => row.seq,
            Claimed::Undecodable { seq, .. } => *seq,
        }
    }
}

/// Decodes one claimed row. `seq` and `partition` are non-null integers (they always decode);
/// anything else that does not decode (headers nested beyond serde_json's limit or not an object,
/// an infinite `created_at`, text that is not UTF-8 in a SQL_ASCII database) makes the row
/// [`Claimed::Undecodable`] with the reason. Returns `Err` only if seq or partition fail.
fn decode_row(r: &sqlx::postgres::PgRow) -> Result<Claimed, sqlx::Error> {
    let seq: i64 = r.try_get("seq")?;
    let partition: i16 = r.try_get("partition")?;
    let decoded = (|| -> Result<OutboxRow, String> {
        let text = |name: &str| {
            r.try_get::<String, _>(name)
                .map_err(|e| format!("{name}: {e}"))
        };
        let headers_text = text("headers")?;
        let headers: Map<String, Value> = serde_json::from_str(&headers_text)
            .map_err(|e| format!("headers cannot be decoded as a JSON object: {e}"))?;
        let created_at: Option<DateTime<Utc>> = r
            .try_get("created_at")
            .map_err(|e| format!("created_at: {e}"))?;
        Ok(OutboxRow {
            seq,
            id: r.try_get("id").map_err(|e| format!("id: {e}"))?,
            aggregate_type: text("aggregate_type")?,
            aggregate_id: text("aggregate_id")?,
            aggregate_seq: r
                .try_get("aggregate_seq")
                .map_err(|e| format!("aggregate_seq: {e}"))?,
            event_type: text("event_type")?,
            payload: text("payload")?,
            headers,
            created_at: created_at.ok_or("created_at is not a finite time")?,
            attempts: r
                .try_get("attempts")
                .map_err(|e| format!("attempts: {e}"))?,
            partition,
        })
    })();
    Ok(match decoded {
        Ok(row) => Claimed::Row(row),
        Err(reason) => Claimed::Undecodable {
            seq,
            partition,
            reason: format!("undecodable: {reason}"),
        },
    })
}

/// Marks confirmed rows: deletes them, or keeps them as `published` when a retention is set.
///
/// The commit does not wait for the WAL flush (`synchronous_commit = off` for this transaction
/// only): if PostgreSQL itself crashes within a fraction of a second after, the mark may be lost
/// and those rows published again, which at-least-once allows; nothing can be lost that way.
pub async fn mark_published(
    pool: &PgPool,
    schema: &Schema,
    seqs: &[i64],
    retain: bool,
    statements: Statements,
) -> Result<(), sqlx::Error> {
    if seqs.is_empty() {
        return Ok(());
    }
    let prepared = statements.prepared();
    let mut tx = begin_indexed(pool, true).await?;
    if retain {
        sqlx::query(schema.sql(
            "UPDATE {{schema}}.messages SET state = 'published', published_at = now() \
             WHERE seq = ANY($1) AND state = 'pending'",
        ))
        .bind(seqs)
        .persistent(prepared)
        .execute(&mut *tx)
        .await?;
    } else {
        sqlx::query(schema.sql("DELETE FROM {{schema}}.messages WHERE seq = ANY($1)"))
            .bind(seqs)
            .persistent(prepared)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Unblocks partitions whose blocking row has now been published.
pub async fn unblock_published(
    pool: &PgPool,
    schema: &Schema,
    seqs: &[i64],
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        schema.sql("UPDATE {{schema}}.relay_partitions SET blocked_until = NULL, blocked_seq = NULL WHERE blocked_seq = ANY($1)"),
    )
    .bind(seqs)
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// What became of a failed row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailedState {
    /// Will be retried after the partition's block.
    Retry,
    /// Exhausted max attempts.
    Dead,
}

/// How a failure counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    /// One attempt of `max_attempts`: retried after the backoff, dead after the last.
    Attempt {
        max_attempts: u32,
        retry_in: Duration,
    },
    /// The row can never be published as it is (it broke a rule, does not fit a frame, cannot be
    /// decoded): dead at once, retrying cannot help.
    Unpublishable,
}

/// Records a failed attempt on one row, and blocks its partition until the retry delay has passed
/// (or unblocks it if the row is now dead, so the rest of the partition moves on).
pub async fn record_failure(
    pool: &PgPool,
    schema: &Schema,
    seq: i64,
    partition: i16,
    error: &str,
    charge: Charge,
) -> Result<FailedState, sqlx::Error> {
    let (max_attempts, retry_in) = match charge {
        Charge::Attempt {
            max_attempts,
            retry_in,
        } => (max_attempts, retry_in),
        Charge::Unpublishable => (0, Duration::ZERO),
    };
    let mut tx = pool.begin().await?;
    let state: Option<String> = sqlx::query_scalar(
        schema.sql("UPDATE {{schema}}.messages SET attempts = attempts + 1, last_error = $2, last_attempt_at = now(), \
                state = CASE WHEN attempts + 1 >= $3 THEN 'dead' ELSE 'pending' END \
         WHERE seq = $1 AND state = 'pending' RETURNING state"),
    )
    .bind(seq)
    .bind(error)
    .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
    .persistent(false)
    .fetch_optional(&mut *tx)
    .await?;
    let failed = match state.as_deref() {
        Some("dead") => FailedState::Dead,
        _ => FailedState::Retry,
    };
    match failed {
        FailedState::Retry => {
            sqlx::query(schema.sql(
                "UPDATE {{schema}}.relay_partitions \
                 SET blocked_until = now() + make_interval(secs => $2), blocked_seq = $3 \
                 WHERE partition = $1",
            ))
            .bind(partition)
            .bind(retry_in.as_secs_f64())
            .bind(seq)
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        }
        FailedState::Dead => {
            sqlx::query(schema.sql(
                "UPDATE {{schema}}.relay_partitions SET blocked_until = NULL, blocked_seq = NULL \
                 WHERE partition = $1 AND blocked_seq = $2",
            ))
            .bind(partition)
            .bind(seq)
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok(failed)
}

/// Deletes published rows older than the retention, at most `batch` rows per call, the oldest
/// first from `after` (the newest `published_at` the previous call of a pass deleted, `None` at
/// the start of a pass). Returns how many it deleted and the newest `published_at` among them.
///
/// A pass goes on from where its last call ended rather than from the start of the index: while
/// an old snapshot holds back vacuum, the entries of rows deleted since stay, and walking them in
/// every call would make a pass cost the square of what it deletes. A row published behind the
/// cursor (a late confirm) is deleted by the next pass. The batch's rows are probed by their key
/// (an array, so no plan joins the batch to the whole table).
pub async fn purge_published(
    pool: &PgPool,
    schema: &Schema,
    older_than: Duration,
    batch: i64,
    after: Option<DateTime<Utc>>,
) -> Result<(u64, Option<DateTime<Utc>>), sqlx::Error> {
    let mut tx = pool.begin().await?;
    let (n, last): (i64, Option<DateTime<Utc>>) = sqlx::query_as(schema.sql(
        "WITH gone AS ( \
             DELETE FROM {{schema}}.messages WHERE seq = ANY(ARRAY( \
                 SELECT seq FROM {{schema}}.messages \
                 WHERE state = 'published' AND published_at < now() - make_interval(secs => $1) \
                   AND published_at >= coalesce($3, '-infinity') \
                 ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)) \
             RETURNING published_at) \
         SELECT count(*), max(published_at) FROM gone",
    ))
    .bind(older_than.as_secs_f64())
    .bind(batch)
    .bind(after)
    .persistent(false)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((n as u64, last.or(after)))
}

/// What holds back cleanup in the database (issue 39): while a snapshot is old, no row deleted or
/// updated after it began can be vacuumed away, in any table.
#[derive(Debug, Clone, Default)]
pub struct Horizon {
    /// Age of the oldest transaction holding a snapshot in this database (a session, a
    /// `hot_standby_feedback` walsender, a prepared transaction), in seconds.
    pub oldest_snapshot_age: f64,
    /// How many transactions ago the oldest xmin holding back cleanup was taken, replication
    /// slots included (a slot has no start time).
    pub oldest_xmin_age: i64,
    /// Dead tuples per table of the product's schema (partitions summed into their table).
    pub dead_tuples: Vec<(String, i64)>,
}

/// Reads [`Horizon`]: `pg_stat_activity`, `pg_prepared_xacts`, `pg_replication_slots` and
/// `pg_stat_user_tables`, nothing of the outbox itself.
pub async fn horizon(pool: &PgPool, schema: &Schema) -> Result<Horizon, sqlx::Error> {
    let row = sqlx::query(
        "SELECT greatest( \
             (SELECT max(extract(epoch FROM now() - coalesce(xact_start, backend_start))) \
              FROM pg_stat_activity WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() \
                AND (datname = current_database() OR backend_type = 'walsender')), \
             (SELECT max(extract(epoch FROM now() - prepared)) FROM pg_prepared_xacts \
              WHERE database = current_database()), 0)::float8 AS snapshot_age, \
                greatest( \
             (SELECT max(age(backend_xmin)) FROM pg_stat_activity \
              WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()), \
             (SELECT max(age(xmin)) FROM pg_replication_slots WHERE xmin IS NOT NULL), 0)::int8 AS xmin_age",
    )
    .persistent(false)
    .fetch_one(pool)
    .await?;
    let dead_tuples = sqlx::query_as(
        "SELECT coalesce(parent.relname, c.relname)::text, sum(s.n_dead_tup)::int8 \
         FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
         LEFT JOIN pg_inherits i ON i.inhrelid = c.oid \
         LEFT JOIN pg_class parent ON parent.oid = i.inhparent \
         WHERE s.schemaname = $1 GROUP BY 1 ORDER BY 1",
    )
    .bind(schema.name())
    .persistent(false)
    .fetch_all(pool)
    .await?;
    Ok(Horizon {
        oldest_snapshot_age: row.try_get("snapshot_age")?,
        oldest_xmin_age: row.try_get("xmin_age")?,
        dead_tuples,
    })
}

/// Backlog figures for the gauges.
#[derive(Debug, Clone, Copy)]
pub struct Backlog {
    pub pending: i64,
    pub oldest_age: Duration,
    pub dead: i64,
}

/// Counts pending and dead rows; the oldest pending age comes from the head of each partition
/// (64 index probes), not from a scan.
pub async fn backlog(pool: &PgPool, schema: &Schema) -> Result<Backlog, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let row = sqlx::query(
        schema.sql("SELECT (SELECT count(*) FROM {{schema}}.messages WHERE state = 'pending') AS pending, \
                (SELECT count(*) FROM {{schema}}.messages WHERE state = 'dead') AS dead, \
                (SELECT extract(epoch FROM now() - min(h.created_at) FILTER (WHERE isfinite(h.created_at)))::float8 FROM generate_series(0, 63) p \
                 CROSS JOIN LATERAL (SELECT created_at FROM {{schema}}.messages o \
                     WHERE o.partition = p AND o.state = 'pending' ORDER BY o.seq LIMIT 1) h) AS oldest"),
    )
    .persistent(false)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    let oldest: Option<f64> = row.try_get("oldest")?;
    Ok(Backlog {
        pending: row.try_get("pending")?,
        dead: row.try_get("dead")?,
        oldest_age: Duration::try_from_secs_f64(oldest.unwrap_or(0.0).max(0.0)).unwrap_or_default(),
    })
}
