//! The worker's SQL: the claim, heartbeats, and every write fenced by the lease token.
//!
//! Fencing: every write changes or locks the process row only if it still carries the writer's
//! token (`... WHERE id = $1 AND lease_token = $2`, the lock held to commit). A claim takes a new
//! token under the same row lock, so after a takeover the old owner's writes match no row: they
//! are fenced off, and the caller gets [`Fenced`]. Under READ COMMITTED a fenced write that waits
//! for a concurrent claim re-checks the token on the row the claim committed, so the check and the
//! write are one step: there is no window between them.
//!
//! Round trips: the claim returns each process with its steps (no reload); a local checkpoint is
//! one statement for any number of steps, fenced by itself ([`checkpoint_local`]).

use crate::definition::{Remote, Role};
use crate::fair::{FairShare, Passes};
use crate::status::{ProcessStatus, StepStatus};
use chrono::{DateTime, Utc};
use serde_json::Value;
use shared::schema::Schema;
use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, PgPool, Row};
use std::time::Duration;
use uuid::Uuid;

/// A write matched no row: the lease was taken over (the token changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease lost: the write was fenced off")]
pub struct Fenced;

/// Errors of a fenced write.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Fenced(#[from] Fenced),
    #[error("database")]
    Database(#[from] sqlx::Error),
}

/// The lease a claim took on one process: the schema it lives in, the process and the fencing
/// token the claim drew. A turn's every write goes through it (as underway hands its
/// `InProgressTask` around), so no write can name another process or an older token by mistake.
/// Each write matches the process row only while it carries this token: after a takeover (a new
/// claim, or an operator's action, drew a newer one) every write returns [`Fenced`] and changes
/// nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    schema: Schema,
    id: Uuid,
    token: i64,
}

impl Lease {
    /// The process the lease is on.
    pub fn id(&self) -> Uuid {
        self.id
    }

    /// The fencing token the claim drew.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// The schema the process lives in.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Extends the lease; `Fenced` if it was taken over.
    pub async fn heartbeat(&self, pool: &PgPool, lease: Duration) -> Result<(), WriteError> {
        let r = sqlx::query(self.schema.sql(
            "UPDATE {{schema}}.processes SET lease_until = now() + make_interval(secs => $3::float8), \
             next_run_at = now() + make_interval(secs => $3::float8) \
             WHERE id = $1 AND lease_token = $2 AND lease_owner IS NOT NULL",
        ))
        .bind(self.id)
        .bind(self.token)
        .bind(lease.as_secs_f64())
        .execute(pool)
        .await?;
        matched(r.rows_affected())
    }

    /// Locks the process row if the token is still current (the start of every fenced
    /// transaction).
    pub async fn fence(&self, conn: &mut PgConnection) -> Result<(), WriteError> {
        let r = sqlx::query(self.schema.sql(
            "SELECT 1 AS one FROM {{schema}}.processes WHERE id = $1 AND lease_token = $2 FOR UPDATE",
        ))
        .bind(self.id)
        .bind(self.token)
        .fetch_optional(&mut *conn)
        .await?;
        matched(u64::from(r.is_some()))
    }

    /// Applies `change` to step `seq`, fenced by the token (alone or inside a fenced
    /// transaction).
    pub async fn change_step<'e, E: sqlx::PgExecutor<'e>>(
        &self,
        conn: E,
        seq: i32,
        change: &StepChange<'_>,
    ) -> Result<(), WriteError> {
        let c = change.columns();
        let r = sqlx::query(self.schema.sql(STEP_UPDATE))
            .bind(self.id)
            .bind(self.token)
            .bind(seq)
            .bind(c.status)
            .bind(c.count_attempt)
            .bind(c.at)
            .bind(c.class)
            .bind(c.message)
            .bind(c.remote_ref)
            .bind(c.result_ref)
            .bind(c.output.map(sqlx::types::Json))
            .bind(crate::redact::truncate(c.reason, 1000))
            .bind(c.waiting)
            .bind(c.waiting_for)
            .execute(conn)
            .await?;
        matched(r.rows_affected())
    }

    /// The checkpoint of local steps whose effects ran in `conn`'s transaction, in one
    /// statement: every step in `done` becomes succeeded (an attempt counted, its reference as
    /// the result) and, with `finish`, the process ends and its lease is released. The statement
    /// takes the fence itself (the process row, locked to commit, must carry the token), so the
    /// effects commit with their checkpoints or, fenced, not at all: on [`Fenced`] the caller
    /// must roll back.
    pub async fn checkpoint_local(
        &self,
        conn: &mut PgConnection,
        done: &[LocalSuccess<'_>],
        finish: Option<(Finish, &str)>,
    ) -> Result<(), WriteError> {
        let seqs: Vec<i32> = done.iter().map(|d| d.seq).collect();
        let references: Vec<String> = done
            .iter()
            .map(|d| crate::redact::truncate(d.reference, 500))
            .collect();
        let outputs: Vec<Option<String>> = done
            .iter()
            .map(|d| d.output.map(Value::to_string))
            .collect();
        let (template, fence) = if finish.is_some() {
            (
                CHECKPOINT_FINISH,
                "EXISTS (SELECT 1 FROM {{schema}}.processes WHERE id = $1 AND lease_token = $2)",
            )
        } else {
            (CHECKPOINT_ONLY, "EXISTS (SELECT 1 FROM fence)")
        };
        let sql = template.replace("{{steps}}", &CHECKPOINT_STEPS.replace("{{fence}}", fence));
        let mut q = sqlx::query(self.schema.sql(&sql))
            .bind(self.id)
            .bind(self.token)
            .bind(&seqs)
            .bind(&references)
            .bind(&outputs);
        if let Some((end, reason)) = finish {
            q = q
                .bind(end.status())
                .bind(crate::redact::truncate(reason, 1000));
        }
        let r = q.fetch_one(&mut *conn).await?;
        let steps: i64 = r.try_get("steps")?;
        let processes: i64 = r.try_get("processes")?;
        let all = done.len() as i64;
        match (steps, processes) {
            // No step row under our token, or every one but the process row taken over meanwhile.
            (0, _) => Err(Fenced.into()),
            (n, 0) if n == all => Err(Fenced.into()),
            (n, 1) if n == all => Ok(()),
            // The claim loaded these steps under the same token: a missing row is a bug, never data.
            (n, p) => Err(WriteError::Database(sqlx::Error::Protocol(format!(
                "checkpoint matched {n} of {} step rows and {p} process rows",
                done.len()
            )))),
        }
    }

    /// Applies `change` to the process inside `conn`'s transaction, which must hold the fence.
    pub async fn change_process(
        &self,
        conn: &mut PgConnection,
        change: ProcessChange,
        reason: &str,
    ) -> Result<(), WriteError> {
        let reason = crate::redact::truncate(reason, 1000);
        let (status_sql, keep_lease, next) = change.columns();
        let lease = if keep_lease {
            ""
        } else {
            "lease_owner = NULL, lease_until = NULL,"
        };
        let sql = format!(
            "UPDATE {{{{schema}}}}.processes SET status = {status_sql}, {lease} \
             next_run_at = CASE WHEN $4::timestamptz IS NOT NULL THEN $4 WHEN $5 THEN next_run_at ELSE now() END, \
             finished_at = CASE WHEN {status_sql} IN ('succeeded', 'failed', 'compensated') THEN now() END, \
             last_reason = CASE WHEN {status_sql} = status THEN last_reason ELSE $3 END, \
             last_actor = 'system', updated_at = now() \
             WHERE id = $1 AND lease_token = $2"
        );
        let r = sqlx::query(self.schema.sql(&sql))
            .bind(self.id)
            .bind(self.token)
            .bind(reason)
            .bind(next)
            .bind(keep_lease)
            .execute(&mut *conn)
            .await?;
        matched(r.rows_affected())
    }

    /// Inserts the compensation steps (already in the order they run), fenced: inside the
    /// caller's transaction, which it locks to the token first if it did not yet.
    pub async fn add_compensations(
        &self,
        conn: &mut PgConnection,
        steps: &[NewCompensation],
        reason: &str,
    ) -> Result<(), WriteError> {
        self.fence(conn).await?;
        add_compensations(conn, &self.schema, self.id, self.token, steps, reason).await?;
        Ok(())
    }

    /// A wait or timer step begins waiting (pending -> running, an attempt counted): its key
    /// (for a wait) and until when, fenced by the token.
    pub async fn begin_wait(
        &self,
        conn: &mut PgConnection,
        seq: i32,
        key: Option<&str>,
        until: DateTime<Utc>,
        reason: &str,
    ) -> Result<(), WriteError> {
        let r = sqlx::query(self.schema.sql(
            "WITH fence AS (SELECT id FROM {{schema}}.processes WHERE id = $1 AND lease_token = $2 FOR UPDATE) \
             UPDATE {{schema}}.process_steps SET status = 'running', attempts = attempts + 1, \
                 first_attempt_at = coalesce(first_attempt_at, now()), last_attempt_at = now(), \
                 wait_key = $4, wait_since = now(), wait_until = $5, last_reason = $6, \
                 last_actor = 'system', lease_token = $2, updated_at = now() \
             WHERE process_id = $1 AND seq = $3 AND EXISTS (SELECT 1 FROM fence)",
        ))
        .bind(self.id)
        .bind(self.token)
        .bind(seq)
        .bind(key)
        .bind(until)
        .bind(crate::redact::truncate(reason, 1000))
        .execute(&mut *conn)
        .await?;
        matched(r.rows_affected())
    }

    /// Every step of the process, in order (a read: not fenced).
    pub async fn steps(&self, conn: &mut PgConnection) -> Result<Vec<StepRow>, sqlx::Error> {
        steps(conn, &self.schema, self.id).await
    }

    /// The event stored for `key` by [`crate::signal()`], if any (a read: not fenced).
    pub async fn event(
        &self,
        conn: &mut PgConnection,
        key: &str,
    ) -> Result<Option<Value>, sqlx::Error> {
        event(conn, &self.schema, key).await
    }
}

/// A fenced write that matched no row was fenced off.
fn matched(rows: u64) -> Result<(), WriteError> {
    if rows == 0 {
        return Err(Fenced.into());
    }
    Ok(())
}

/// A process a worker claimed.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The claim's lease: every write of the turn goes through it.
    pub lease: Lease,
    pub kind: String,
    pub version: i32,
    pub business_key: String,
    pub status: ProcessStatus,
    pub input: Value,
    pub deadline_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// The owner whose expired lease this claim took over, if any.
    pub previous_owner: Option<String>,
    /// Every step of the process, in order, as the claim found them.
    pub steps: Vec<StepRow>,
}

/// One step row as the worker needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRow {
    pub seq: i32,
    pub name: String,
    pub role: Role,
    pub acts_on: Option<i32>,
    pub remote: Option<Remote>,
    pub status: StepStatus,
    pub operation_id: Uuid,
    pub attempts: i32,
    pub max_attempts: i32,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub first_attempt_at: Option<DateTime<Utc>>,
    pub error_class: Option<String>,
    pub remote_ref: Option<String>,
    pub result_ref: Option<String>,
    pub output: Option<Value>,
    /// Wait steps: the awaited event's key, once the wait began.
    pub wait_key: Option<String>,
    /// Wait steps: the deadline; timers: when to continue.
    pub wait_until: Option<DateTime<Utc>>,
    /// Since when the step has waited for an unavailable remote (cleared by any other outcome).
    pub waiting_since: Option<DateTime<Utc>>,
    /// The dependency whose wake-up the step waits for: still set when the step was claimed on its
    /// own timer rather than woken (the wake-up clears it).
    pub waiting_for: Option<String>,
}

impl Claimed {
    /// The claimed process.
    pub fn id(&self) -> Uuid {
        self.lease.id()
    }
}

impl StepRow {
    pub fn reference(&self) -> Option<&str> {
        self.remote_ref.as_deref().or(self.result_ref.as_deref())
    }
}

/// Takes the chosen rows `c` (id, previous owner): leases them and returns each with its steps.
const TAKE: &str = "\
UPDATE {{schema}}.processes p SET
    status = CASE WHEN p.status IN ('pending', 'waiting') THEN 'running' ELSE p.status END,
    last_reason = CASE
        WHEN c.previous_owner IS NOT NULL THEN 'lease of ' || c.previous_owner || ' expired; taken over by ' || $3
        WHEN p.status IN ('pending', 'waiting') THEN 'claimed by ' || $3
        ELSE p.last_reason END,
    last_actor = 'system',
    lease_owner = $3,
    lease_until = now() + make_interval(secs => $4::float8),
    next_run_at = now() + make_interval(secs => $4::float8),
    lease_token = nextval('{{schema}}.process_lease_tokens'),
    attempt = p.attempt + 1,
    updated_at = now()
FROM c WHERE p.id = c.id
RETURNING p.id, p.kind, p.definition_version, p.business_key, p.status, p.input, p.lease_token,
          p.deadline_at, p.created_at, c.previous_owner{{returning}},
          (SELECT json_agg(s ORDER BY s.seq) FROM (
              SELECT seq, name, role, acts_on, remote, status, operation_id, attempts, max_attempts,
                     next_attempt_at, first_attempt_at, error_class, remote_ref, result_ref, output,
                     wait_key, wait_until, waiting_since, waiting_for
              FROM {{schema}}.process_steps WHERE process_id = p.id) s) AS steps";

const CLAIM: &str = "\
WITH c AS (
    SELECT p.id, p.lease_owner AS previous_owner, p.next_run_at AS due_at
    FROM {{schema}}.processes p
    WHERE {{due}} AND p.next_run_at >= coalesce($5, '-infinity')
    ORDER BY p.next_run_at
    LIMIT {{limit}}
    FOR UPDATE OF p SKIP LOCKED
)
{{take}}";

/// Claims up to `limit` due processes of the known (kind, version) pairs, each with its steps,
/// the oldest due first from `from` (a [`crate::claim_floor::ClaimFloor`]; `None` reads from the
/// front). Returns them and the oldest due time among them.
///
/// The limit is written into the statement, not bound: with a bound limit PostgreSQL plans every
/// claim anew (the plan for the actual limit always looks cheaper than the generic one), with a
/// literal one it keeps a generic plan per limit after five claims.
#[allow(clippy::too_many_arguments)]
pub async fn claim(
    conn: &mut PgConnection,
    schema: &Schema,
    kinds: &[String],
    versions: &[i32],
    limit: i64,
    owner: &str,
    lease: Duration,
    from: Option<DateTime<Utc>>,
) -> Result<(Vec<Claimed>, Option<DateTime<Utc>>), sqlx::Error> {
    let sql = CLAIM
        .replace("{{take}}", TAKE)
        .replace("{{returning}}", ", c.due_at")
        .replace("{{due}}", DUE)
        .replace("{{limit}}", &limit.max(1).to_string());
    let rows = sqlx::query(schema.sql(&sql))
        .bind(kinds)
        .bind(versions)
        .bind(owner)
        .bind(lease.as_secs_f64())
        .bind(from)
        .fetch_all(&mut *conn)
        .await?;
    let oldest = rows
        .iter()
        .filter_map(|r| r.try_get::<DateTime<Utc>, _>("due_at").ok())
        .min();
    Ok((claimed_rows(&rows, schema), oldest))
}

/// The claimed rows that can be read. One unreadable row must not hold up the others: it is left
/// to its lease (and claimed and skipped again after it), as a process whose steps cannot be read
/// always was.
fn claimed_rows(rows: &[PgRow], schema: &Schema) -> Vec<Claimed> {
    rows.iter()
        .filter_map(|r| match claimed(r, schema) {
            Ok(c) => Some(c),
            Err(e) => {
                let id: Option<Uuid> = r.try_get("id").ok();
                tracing::warn!(process = ?id, error = %e, "claimed process unreadable; left to its lease");
                None
            }
        })
        .collect()
}

/// What makes a process claimable: due, unpaused, in a worker-driven status, not held, of a
/// known (kind, version).
const DUE: &str = "p.status IN ('pending', 'running', 'waiting', 'compensating') AND NOT p.paused \
    AND p.next_run_at <= now() AND (p.lease_until IS NULL OR p.lease_until < now()) \
    AND (p.kind, p.definition_version) IN (SELECT k, v FROM unnest($1::text[], $2::int[]) AS u(k, v))";

/// The fair claim ([`crate::fair`]): walks up to `{{keys}}` distinct due keys after `$5` (a skip
/// scan of `processes_fair_due_idx`, one probe per key), adds the group without a key if it has
/// due work, gives each group a quota by weight, locks each group's oldest due rows, and takes
/// the `{{limit}}` with the lowest turn (`max(pass, virtual time) + rank / weight`).
const CLAIM_FAIR: &str = "\
WITH RECURSIVE walk(k, n) AS (
    (SELECT p.fair_key, 1 FROM {{schema}}.processes p
     WHERE p.fair_key > $5 AND {{due}} ORDER BY p.fair_key LIMIT 1)
  UNION ALL
    SELECT (SELECT p.fair_key FROM {{schema}}.processes p
            WHERE p.fair_key > walk.k AND {{due}} ORDER BY p.fair_key LIMIT 1), walk.n + 1
    FROM walk WHERE walk.k IS NOT NULL AND walk.n < {{keys}}
), keys AS (
    SELECT k FROM walk WHERE k IS NOT NULL
), groups AS (
    SELECT k, false AS unkeyed FROM keys
    UNION ALL
    SELECT NULL, true WHERE EXISTS (SELECT 1 FROM {{schema}}.processes p WHERE p.fair_key IS NULL AND {{due}})
), weighted AS (
    SELECT g.k, g.unkeyed, w.weight,
           greatest(coalesce(s.pass, $10), $10) AS pass,
           least({{limit}}, greatest(1, ceil({{limit}} * w.weight / sum(w.weight) OVER ())))::int AS quota
    FROM groups g
    CROSS JOIN LATERAL (SELECT coalesce((SELECT x.w FROM unnest($8::text[], $9::float8[]) AS x(k, w)
                                         WHERE x.k = g.k), $11) AS weight) w
    LEFT JOIN unnest($6::text[], $7::float8[]) AS s(k, pass) ON s.k IS NOT DISTINCT FROM g.k
), locked AS (
    SELECT c.id, c.previous_owner, w.k, w.pass + (row_number() OVER (PARTITION BY w.k ORDER BY c.next_run_at, c.id))::float8 / w.weight AS turn
    FROM weighted w CROSS JOIN LATERAL (
        SELECT * FROM (SELECT p.id, p.lease_owner AS previous_owner, p.next_run_at FROM {{schema}}.processes p
                       WHERE NOT w.unkeyed AND p.fair_key = w.k AND {{due}}
                       ORDER BY p.next_run_at LIMIT w.quota FOR UPDATE OF p SKIP LOCKED) keyed
        UNION ALL
        SELECT * FROM (SELECT p.id, p.lease_owner AS previous_owner, p.next_run_at FROM {{schema}}.processes p
                       WHERE w.unkeyed AND p.fair_key IS NULL AND {{due}}
                       ORDER BY p.next_run_at LIMIT w.quota FOR UPDATE OF p SKIP LOCKED) unkeyed
    ) c
), c AS (
    SELECT * FROM locked ORDER BY turn, id LIMIT {{limit}}
)
{{take}}";

/// [`claim`] by weighted fair share ([`crate::fair`]): the worker's `passes` say where each key
/// stands and are moved on by what this claim took.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn claim_fair(
    conn: &mut PgConnection,
    schema: &Schema,
    kinds: &[String],
    versions: &[i32],
    limit: i64,
    owner: &str,
    lease: Duration,
    share: &FairShare,
    passes: &mut Passes,
) -> Result<Vec<Claimed>, sqlx::Error> {
    let keys = share.keys_per_claim_limit();
    let returning = ", c.k AS fair_key, c.turn AS fair_turn, \
        (SELECT array_agg(k) FROM groups) AS fair_groups";
    let sql = CLAIM_FAIR
        .replace("{{take}}", TAKE)
        .replace("{{returning}}", returning)
        .replace("{{due}}", DUE)
        .replace("{{limit}}", &limit.max(1).to_string())
        .replace("{{keys}}", &keys.to_string());
    let (pass_keys, pass_values) = passes.arrays();
    let (weight_keys, weight_values) = share.weight_arrays();
    let rows = sqlx::query(schema.sql(&sql))
        .bind(kinds)
        .bind(versions)
        .bind(owner)
        .bind(lease.as_secs_f64())
        .bind(passes.cursor())
        .bind(&pass_keys)
        .bind(&pass_values)
        .bind(&weight_keys)
        .bind(&weight_values)
        .bind(passes.virtual_time())
        .bind(share.default_weight_value())
        .fetch_all(&mut *conn)
        .await?;
    let mut turns = Vec::with_capacity(rows.len());
    let mut groups = Vec::new();
    for r in &rows {
        turns.push((r.try_get("fair_key")?, r.try_get::<f64, _>("fair_turn")?));
        groups = r.try_get("fair_groups")?;
    }
    passes.after_claim(&turns, &groups, keys);
    Ok(claimed_rows(&rows, schema))
}

/// A claimed row as the claim returns it.
#[derive(sqlx::FromRow)]
struct ClaimRow {
    id: Uuid,
    kind: String,
    definition_version: i32,
    business_key: String,
    status: ProcessStatus,
    input: sqlx::types::Json<Value>,
    lease_token: i64,
    deadline_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    previous_owner: Option<String>,
    steps: Option<sqlx::types::Json<Vec<StepColumns>>>,
}

fn claimed(r: &PgRow, schema: &Schema) -> Result<Claimed, sqlx::Error> {
    let r = ClaimRow::from_row(r)?;
    Ok(Claimed {
        lease: Lease {
            schema: schema.clone(),
            id: r.id,
            token: r.lease_token,
        },
        kind: r.kind,
        version: r.definition_version,
        business_key: r.business_key,
        status: r.status,
        input: r.input.0,
        deadline_at: r.deadline_at,
        created_at: r.created_at,
        previous_owner: r.previous_owner,
        steps: r
            .steps
            .map(|j| j.0.into_iter().map(StepRow::from).collect())
            .unwrap_or_default(),
    })
}

/// A step row as the claim returns it (`json_agg` of the step columns) and [`steps`] reads it.
#[derive(Debug, serde::Deserialize, sqlx::FromRow)]
struct StepColumns {
    seq: i32,
    name: String,
    role: String,
    acts_on: Option<i32>,
    remote: Option<String>,
    status: StepStatus,
    operation_id: Uuid,
    attempts: i32,
    max_attempts: i32,
    next_attempt_at: Option<DateTime<Utc>>,
    first_attempt_at: Option<DateTime<Utc>>,
    error_class: Option<String>,
    remote_ref: Option<String>,
    result_ref: Option<String>,
    output: Option<Value>,
    wait_key: Option<String>,
    wait_until: Option<DateTime<Utc>>,
    waiting_since: Option<DateTime<Utc>>,
    waiting_for: Option<String>,
}

impl From<StepColumns> for StepRow {
    fn from(s: StepColumns) -> Self {
        StepRow {
            seq: s.seq,
            name: s.name,
            role: Role::parse(&s.role).unwrap_or(Role::Resolution),
            acts_on: s.acts_on,
            remote: s.remote.as_deref().and_then(Remote::parse),
            status: s.status,
            operation_id: s.operation_id,
            attempts: s.attempts,
            max_attempts: s.max_attempts,
            next_attempt_at: s.next_attempt_at,
            first_attempt_at: s.first_attempt_at,
            error_class: s.error_class,
            remote_ref: s.remote_ref,
            result_ref: s.result_ref,
            output: s.output,
            wait_key: s.wait_key,
            wait_until: s.wait_until,
            waiting_since: s.waiting_since,
            waiting_for: s.waiting_for,
        }
    }
}

/// Wakes up to `n` steps waiting for `dependency`, the longest-waiting first: each becomes due
/// now, and so does its process (if it is still waiting, not paused and not held). Returns how
/// many were woken.
pub async fn wake_waiting(
    pool: &PgPool,
    schema: &Schema,
    dependency: &str,
    n: u32,
) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(schema.sql(
        "WITH w AS ( \
             SELECT s.process_id, s.seq FROM {{schema}}.process_steps s \
             JOIN {{schema}}.processes p ON p.id = s.process_id \
             WHERE s.waiting_for = $1 AND s.status = 'retryable' \
               AND p.status = 'waiting' AND NOT p.paused \
             ORDER BY s.waiting_since, s.process_id LIMIT $2 \
             FOR UPDATE OF p SKIP LOCKED), \
         steps AS ( \
             UPDATE {{schema}}.process_steps s SET next_attempt_at = now(), waiting_for = NULL \
             FROM w WHERE s.process_id = w.process_id AND s.seq = w.seq RETURNING s.process_id) \
         UPDATE {{schema}}.processes p SET next_run_at = now() \
         FROM w WHERE p.id = w.process_id",
    ))
    .bind(dependency)
    .bind(i64::from(n))
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}

/// Whether any step waits for `dependency` (read through the wake-up's index).
pub async fn any_waiting(
    pool: &PgPool,
    schema: &Schema,
    dependency: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        schema.sql("SELECT EXISTS (SELECT 1 FROM {{schema}}.process_steps WHERE waiting_for = $1)"),
    )
    .bind(dependency)
    .fetch_one(pool)
    .await
}

/// Steps waiting for each dependency, and since when the oldest has waited.
pub async fn waiting_by_dependency(
    pool: &PgPool,
    schema: &Schema,
) -> Result<Vec<(String, i64, Option<DateTime<Utc>>)>, sqlx::Error> {
    sqlx::query_as(schema.sql(
        "SELECT waiting_for, count(*), min(waiting_since) FROM {{schema}}.process_steps \
         WHERE waiting_for IS NOT NULL GROUP BY 1 ORDER BY 1",
    ))
    .fetch_all(pool)
    .await
}

/// Due processes whose (kind, version) this worker does not know, by kind and version.
pub async fn unknown_versions(
    pool: &PgPool,
    schema: &Schema,
    kinds: &[String],
    versions: &[i32],
) -> Result<Vec<(String, i32, i64)>, sqlx::Error> {
    sqlx::query_as(schema.sql(
        "SELECT p.kind, p.definition_version, count(*) AS n FROM {{schema}}.processes p \
         WHERE p.status IN ('pending', 'running', 'waiting', 'compensating') AND NOT p.paused \
           AND p.next_run_at <= now() \
           AND (p.kind, p.definition_version) NOT IN (SELECT k, v FROM unnest($1::text[], $2::int[]) AS u(k, v)) \
         GROUP BY 1, 2",
    ))
    .bind(kinds)
    .bind(versions)
    .fetch_all(pool)
    .await
}

const STEP_COLUMNS: &str = "seq, name, role, acts_on, remote, status, operation_id, attempts, max_attempts, \
     next_attempt_at, first_attempt_at, error_class, remote_ref, result_ref, output, wait_key, wait_until, \
     waiting_since, waiting_for";

/// Every step of a process, in order.
pub async fn steps(
    conn: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
) -> Result<Vec<StepRow>, sqlx::Error> {
    let rows = sqlx::query(schema.sql(&format!(
        "SELECT {STEP_COLUMNS} FROM {{{{schema}}}}.process_steps WHERE process_id = $1 ORDER BY seq"
    )))
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(step_row).collect()
}

fn step_row(r: &PgRow) -> Result<StepRow, sqlx::Error> {
    StepColumns::from_row(r).map(StepRow::from)
}

/// How a step row changes.
#[derive(Debug, Clone)]
pub enum StepChange<'a> {
    /// An external attempt begins (committed before the call).
    Begin { reason: &'a str },
    Succeeded {
        /// true: the reference is the remote's (remote_ref), false: a local result (result_ref).
        remote: bool,
        reference: &'a str,
        output: Option<&'a Value>,
        /// Counts an attempt (local steps, whose attempt is the transaction itself).
        count_attempt: bool,
        reason: &'a str,
    },
    Retryable {
        class: &'a str,
        message: &'a str,
        at: DateTime<Utc>,
        count_attempt: bool,
        reason: &'a str,
    },
    /// The remote was unavailable (or its circuit would not let the call go): the step waits
    /// until `at` (or until the dependency's wake-up) without spending an attempt; `uncount`
    /// gives back the attempt its refused call began.
    Waiting {
        /// `unavailable`, or `unknown` for a step whose earlier outcome is still in doubt.
        class: &'a str,
        message: &'a str,
        at: DateTime<Utc>,
        /// The dependency it waits on (woken by its wake-up), if it has one.
        waiting_for: Option<&'a str>,
        uncount: bool,
        reason: &'a str,
    },
    Failed {
        class: &'a str,
        message: &'a str,
        count_attempt: bool,
        reason: &'a str,
    },
    Review {
        class: Option<&'a str>,
        message: Option<&'a str>,
        count_attempt: bool,
        reason: &'a str,
    },
}

/// The columns a [`StepChange`] writes.
struct StepWrite<'a> {
    status: StepStatus,
    /// 1 if the change counts an attempt, -1 if it gives one back.
    count_attempt: i32,
    /// The step waits for an unavailable remote (through `waiting_for`, if it has one).
    waiting: bool,
    waiting_for: Option<&'a str>,
    at: Option<DateTime<Utc>>,
    class: Option<&'a str>,
    message: Option<&'a str>,
    remote_ref: Option<&'a str>,
    result_ref: Option<&'a str>,
    output: Option<&'a Value>,
    reason: &'a str,
}

impl<'a> StepChange<'a> {
    /// What the change writes into the step row.
    fn columns(&self) -> StepWrite<'a> {
        let none = |status, count_attempt: bool, reason| StepWrite {
            status,
            count_attempt: i32::from(count_attempt),
            waiting: false,
            waiting_for: None,
            at: None,
            class: None,
            message: None,
            remote_ref: None,
            result_ref: None,
            output: None,
            reason,
        };
        match *self {
            StepChange::Begin { reason } => none(StepStatus::Running, true, reason),
            StepChange::Succeeded {
                remote,
                reference,
                output,
                count_attempt,
                reason,
            } => StepWrite {
                remote_ref: remote.then_some(reference),
                result_ref: (!remote).then_some(reference),
                output,
                ..none(StepStatus::Succeeded, count_attempt, reason)
            },
            StepChange::Retryable {
                class,
                message,
                at,
                count_attempt,
                reason,
            } => StepWrite {
                at: Some(at),
                class: Some(class),
                message: Some(message),
                ..none(StepStatus::Retryable, count_attempt, reason)
            },
            StepChange::Waiting {
                class,
                message,
                at,
                waiting_for,
                uncount,
                reason,
            } => StepWrite {
                at: Some(at),
                class: Some(class),
                message: Some(message),
                count_attempt: -i32::from(uncount),
                waiting: true,
                waiting_for,
                ..none(StepStatus::Retryable, false, reason)
            },
            StepChange::Failed {
                class,
                message,
                count_attempt,
                reason,
            } => StepWrite {
                class: Some(class),
                message: Some(message),
                ..none(StepStatus::Failed, count_attempt, reason)
            },
            StepChange::Review {
                class,
                message,
                count_attempt,
                reason,
            } => StepWrite {
                class,
                message,
                ..none(StepStatus::ManualReview, count_attempt, reason)
            },
        }
    }
}

const STEP_UPDATE: &str = "\
WITH fence AS (
    SELECT id FROM {{schema}}.processes WHERE id = $1 AND lease_token = $2 FOR UPDATE
)
UPDATE {{schema}}.process_steps SET
    status = $4,
    attempts = attempts + $5,
    first_attempt_at = CASE WHEN $5 > 0 OR $13 THEN coalesce(first_attempt_at, now()) ELSE first_attempt_at END,
    last_attempt_at = CASE WHEN $5 > 0 THEN now() ELSE last_attempt_at END,
    next_attempt_at = CASE WHEN $4 = 'retryable' THEN $6::timestamptz END,
    finished_at = CASE WHEN $4 IN ('succeeded', 'failed') THEN now() END,
    error_class = coalesce($7, error_class),
    error_message = coalesce($8, error_message),
    remote_ref = coalesce($9, remote_ref),
    result_ref = coalesce($10, result_ref),
    output = coalesce($11, output),
    last_reason = $12,
    waiting_for = $14,
    waiting_since = CASE WHEN $13 THEN coalesce(waiting_since, now())
                         WHEN $4 = 'running' THEN waiting_since END,
    last_actor = 'system',
    lease_token = $2,
    updated_at = now()
WHERE process_id = $1 AND seq = $3 AND EXISTS (SELECT 1 FROM fence)";

/// A local step that succeeded inside the caller's transaction.
#[derive(Debug, Clone)]
pub struct LocalSuccess<'a> {
    pub seq: i32,
    pub reference: &'a str,
    pub output: Option<&'a Value>,
}

/// The step updates of a checkpoint; `{{fence}}` is the condition that the token is current.
const CHECKPOINT_STEPS: &str = "\
    s AS (
        UPDATE {{schema}}.process_steps s SET
            status = 'succeeded',
            attempts = s.attempts + 1,
            first_attempt_at = coalesce(s.first_attempt_at, now()),
            last_attempt_at = now(),
            next_attempt_at = NULL,
            finished_at = now(),
            result_ref = u.reference,
            output = coalesce(u.output::jsonb, s.output),
            last_reason = 'succeeded',
            last_actor = 'system',
            lease_token = $2,
            updated_at = now()
        FROM unnest($3::int[], $4::text[], $5::text[]) AS u(seq, reference, output)
        WHERE s.process_id = $1 AND s.seq = u.seq AND {{fence}}
        RETURNING 1
    )";

/// Without the process's end: the fence locks the process row (to commit) if the token is current.
const CHECKPOINT_ONLY: &str = "\
WITH fence AS (
    SELECT id FROM {{schema}}.processes WHERE id = $1 AND lease_token = $2 FOR UPDATE
), {{steps}}
SELECT (SELECT count(*) FROM s) AS steps, 1::bigint AS processes";

/// With the process's end, which reads the step updates' count, so it runs after them (and its
/// trigger, which checks the evidence, sees them). The process update is the fence: it locks the
/// row and, under the lock, finds the token current or matches nothing (a concurrent takeover is
/// re-checked on the row it committed). The steps' own check is only a read; if the process then
/// matches nothing, the caller rolls the step updates back with everything else.
const CHECKPOINT_FINISH: &str = "\
WITH {{steps}},
    p AS (
        UPDATE {{schema}}.processes SET status = $6, lease_owner = NULL, lease_until = NULL,
            next_run_at = now(), finished_at = now(), last_reason = $7, last_actor = 'system',
            updated_at = now()
        WHERE id = $1 AND lease_token = $2 AND (SELECT count(*) FROM s) = cardinality($3::int[])
        RETURNING 1
    )
SELECT (SELECT count(*) FROM s) AS steps, (SELECT count(*) FROM p) AS processes";

/// How a checkpoint ends the process, when its steps were the phase's last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Every forward step succeeded.
    Succeeded,
    /// Every compensation succeeded.
    Compensated,
}

impl Finish {
    fn status(self) -> ProcessStatus {
        match self {
            Finish::Succeeded => ProcessStatus::Succeeded,
            Finish::Compensated => ProcessStatus::Compensated,
        }
    }
}

/// How a process row changes at the end of a worker's turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessChange {
    /// Release the lease; due again now (shutdown, or the next step is due at once).
    Release,
    /// Back off until the step is due (running becomes waiting; compensating stays).
    WaitUntil(DateTime<Utc>),
    Succeeded,
    Failed,
    Compensating,
    Compensated,
    ManualReview,
}

impl ProcessChange {
    /// The new status (an SQL expression over the row), whether the lease is kept, and when the
    /// process is due next (now, unless kept or given).
    fn columns(self) -> (&'static str, bool, Option<DateTime<Utc>>) {
        match self {
            ProcessChange::Release => ("status", false, None),
            ProcessChange::WaitUntil(at) => (
                "CASE WHEN status = 'running' THEN 'waiting' ELSE status END",
                false,
                Some(at),
            ),
            ProcessChange::Succeeded => ("'succeeded'", false, None),
            ProcessChange::Failed => ("'failed'", false, None),
            ProcessChange::Compensating => ("'compensating'", true, None),
            ProcessChange::Compensated => ("'compensated'", false, None),
            ProcessChange::ManualReview => ("'manual_review'", false, None),
        }
    }
}

/// A compensation step to add, linked to the step it undoes.
#[derive(Debug, Clone)]
pub struct NewCompensation {
    pub acts_on: i32,
    pub name: String,
    pub execution: &'static str,
    pub remote: Option<&'static str>,
    pub sensitive: bool,
    pub max_attempts: i32,
    /// What it does in business words, from the definition (`compensation_label`).
    pub label: Option<String>,
}

/// Inserts the compensation steps (already in the order they run), inside the fenced transaction
/// ([`Lease::add_compensations`] takes the fence).
async fn add_compensations(
    conn: &mut PgConnection,
    schema: &Schema,
    id: Uuid,
    token: i64,
    steps: &[NewCompensation],
    reason: &str,
) -> Result<(), sqlx::Error> {
    if steps.is_empty() {
        return Ok(());
    }
    let acts_on: Vec<i32> = steps.iter().map(|s| s.acts_on).collect();
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    let executions: Vec<&str> = steps.iter().map(|s| s.execution).collect();
    let remotes: Vec<Option<&str>> = steps.iter().map(|s| s.remote).collect();
    let sensitive: Vec<bool> = steps.iter().map(|s| s.sensitive).collect();
    let max_attempts: Vec<i32> = steps.iter().map(|s| s.max_attempts).collect();
    let labels: Vec<Option<&str>> = steps.iter().map(|s| s.label.as_deref()).collect();
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.process_steps \
             (process_id, seq, name, role, acts_on, execution, remote, sensitive, status, operation_id, \
              max_attempts, last_reason, lease_token, compensation_label) \
         SELECT $1, (SELECT max(seq) FROM {{schema}}.process_steps WHERE process_id = $1) + c.n, c.name, \
                'compensation', c.acts_on, c.execution, c.remote, c.sensitive, \
                CASE WHEN c.sensitive THEN 'manual_review' ELSE 'pending' END, \
                md5($1::text || '/compensation/' || c.name)::uuid, c.max_attempts, \
                CASE WHEN c.sensitive THEN 'sensitive compensation: waits for approval; ' || $7 ELSE $7 END, $8, c.label \
         FROM unnest($2::int[], $3::text[], $4::text[], $5::text[], $6::bool[], $9::int[], $10::text[]) \
              WITH ORDINALITY AS c(acts_on, name, execution, remote, sensitive, max_attempts, label, n) \
         ORDER BY c.n",
    ))
    .bind(id)
    .bind(&acts_on)
    .bind(&names)
    .bind(&executions)
    .bind(&remotes)
    .bind(&sensitive)
    .bind(crate::redact::truncate(reason, 900))
    .bind(token)
    .bind(&max_attempts)
    .bind(&labels)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The event stored for `key` by [`crate::signal()`], if any.
pub async fn event(
    conn: &mut PgConnection,
    schema: &Schema,
    key: &str,
) -> Result<Option<Value>, sqlx::Error> {
    let r: Option<sqlx::types::Json<Value>> = sqlx::query_scalar(
        schema.sql("SELECT payload FROM {{schema}}.process_events WHERE key = $1"),
    )
    .bind(key)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(r.map(|j| j.0))
}
