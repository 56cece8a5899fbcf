//! Starting a process inside the caller's transaction, and revising one (changed input is a new
//! process linked to the old one).
//!
//! [`start`] takes anything that gives a connection (`&mut *tx`, `&mut conn`, `&pool`), so a
//! process starts, or does not, with the caller's business change; a consumer handler starts one
//! in its effect transaction. The (kind, business key) pair is unique: a second start (a
//! redelivered message, a replayed request) returns the existing process.
//!
//! [`start_in`] is the same start on a `&mut PgConnection` (a transaction derefs to one:
//! `start_in(&mut tx, ...)`) in a given product schema. It is not generic, so its future is
//! `Send` wherever the connection is: use it where the future must be `Send`, such as an axum
//! handler or a `tokio::spawn`ed task that starts a process inside its own transaction. (The
//! generic [`start`] cannot always be proven `Send` for `&mut PgConnection`: rustc reports
//! "implementation of `Acquire` is not general enough", a known limit of its reasoning about
//! higher-ranked lifetimes.)

use crate::definition::Definition;
use crate::error::Error;
use crate::money;
use crate::redact;
use crate::status::ProcessStatus;
use serde::Serialize;
use shared::schema::Schema;
use sqlx::{Acquire, PgConnection, Postgres, Row};
use std::future::Future;
use uuid::Uuid;

/// What [`start`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Started {
    pub id: Uuid,
    /// false when a process with this kind and business key already existed (its id is returned;
    /// for a revised process, the latest revision's).
    pub created: bool,
}

/// The channel workers LISTEN on (`<schema>.processes`); a start notifies it at commit.
pub fn notify_channel(schema: &Schema) -> String {
    format!("{}.processes", schema.name())
}

const INSERT: &str = "\
WITH ins AS (
    INSERT INTO {{schema}}.processes
        (id, kind, definition_version, business_key, revision, revision_of, last_reason, last_actor,
         input, input_redacted, deadline_at, fair_key, money)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
            CASE WHEN $11::float8 IS NULL THEN NULL ELSE now() + make_interval(secs => $11::float8) END,
            $17, $18)
    ON CONFLICT (kind, business_key, revision) DO NOTHING
    RETURNING id
), steps AS (
    INSERT INTO {{schema}}.process_steps
        (process_id, seq, name, role, execution, remote, operation_id, max_attempts, last_reason)
    SELECT ins.id, s.n - 1, s.name, 'forward', s.execution, s.remote,
           md5(ins.id::text || '/forward/' || s.name)::uuid, s.max_attempts, 'created'
    FROM ins, unnest($12::text[], $13::text[], $14::text[], $15::int[])
              WITH ORDINALITY AS s(name, execution, remote, max_attempts, n)
)
SELECT ins.id FROM ins, LATERAL (SELECT pg_notify($16, '')) AS wake";

const LATEST: &str = "SELECT id FROM {{schema}}.processes WHERE kind = $1 AND business_key = $2 \
                      ORDER BY revision DESC LIMIT 1";

/// Starts a process of `definition` for `business_key` with `input`, in the caller's transaction
/// (schema `outbox`; see [`start_in`] for another schema). Returns the existing process if one
/// was started for the same kind and key.
pub async fn start<'c, A, T>(
    conn: A,
    definition: &Definition,
    business_key: &str,
    input: &T,
) -> Result<Started, Error>
where
    A: Acquire<'c, Database = Postgres>,
    T: Serialize + ?Sized,
{
    let start = prepare(definition, business_key, input);
    let mut conn = conn.acquire().await?;
    insert_started(
        &mut conn,
        &Schema::default(),
        definition,
        business_key,
        start?,
    )
    .await
}

/// [`start`] on `conn` (a connection, or a transaction: `&mut tx`) in the product schema
/// `schema`. The future is `Send` (it holds the connection, the schema, the definition and the
/// key, and the input already serialized), so a handler that must return a `Send` future can
/// start a process inside its own transaction.
pub fn start_in<'a, T>(
    conn: &'a mut PgConnection,
    schema: &'a Schema,
    definition: &'a Definition,
    business_key: &'a str,
    input: &T,
) -> impl Future<Output = Result<Started, Error>> + Send + use<'a, T>
where
    T: Serialize + ?Sized,
{
    let start = prepare(definition, business_key, input);
    async move { insert_started(conn, schema, definition, business_key, start?).await }
}

/// The checks before any statement: the input serializes, the key and the definition are valid.
fn prepare<T: Serialize + ?Sized>(
    definition: &Definition,
    business_key: &str,
    input: &T,
) -> Result<serde_json::Value, Error> {
    let input = serde_json::to_value(input).map_err(Error::Input)?;
    if business_key.is_empty() || business_key.len() > 500 {
        return Err(Error::Invalid(
            "a business key has 1 to 500 bytes".to_string(),
        ));
    }
    definition
        .validate()
        .map_err(|e| Error::Invalid(e.to_string()))?;
    Ok(input)
}

async fn insert_started(
    conn: &mut PgConnection,
    schema: &Schema,
    definition: &Definition,
    business_key: &str,
    input: serde_json::Value,
) -> Result<Started, Error> {
    let id = insert(
        conn,
        schema,
        definition,
        business_key,
        0,
        None,
        "started",
        "system",
        &input,
    )
    .await?;
    if let Some(id) = id {
        return Ok(Started { id, created: true });
    }
    // The conflicting row may have committed after our statement's snapshot: look again.
    let row = sqlx::query(schema.sql(LATEST))
        .bind(definition.kind())
        .bind(business_key)
        .fetch_one(&mut *conn)
        .await?;
    Ok(Started {
        id: row.try_get("id")?,
        created: false,
    })
}

#[allow(clippy::too_many_arguments)]
async fn insert(
    conn: &mut PgConnection,
    schema: &Schema,
    definition: &Definition,
    business_key: &str,
    revision: i32,
    revision_of: Option<Uuid>,
    reason: &str,
    actor: &str,
    input: &serde_json::Value,
) -> Result<Option<Uuid>, Error> {
    let redacted = redact::input(input, definition.redacted_fields());
    let steps = definition.steps();
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    let executions: Vec<&str> = steps.iter().map(|s| s.action.execution()).collect();
    let remotes: Vec<Option<&str>> = steps
        .iter()
        .map(|s| s.action.remote().map(|r| r.as_str()))
        .collect();
    let max_attempts: Vec<i32> = steps.iter().map(|s| s.retry.max_attempts.max(1)).collect();
    let row = sqlx::query(schema.sql(INSERT))
        .bind(Uuid::now_v7())
        .bind(definition.kind())
        .bind(definition.version())
        .bind(business_key)
        .bind(revision)
        .bind(revision_of)
        .bind(reason)
        .bind(actor)
        .bind(sqlx::types::Json(input))
        .bind(sqlx::types::Json(&redacted))
        .bind(definition.deadline_duration().map(|d| d.as_secs_f64()))
        .bind(&names)
        .bind(&executions)
        .bind(&remotes)
        .bind(&max_attempts)
        .bind(notify_channel(schema))
        .bind(definition.fair_key_of(input))
        .bind(sqlx::types::Json(money::resolve(
            input,
            definition.money_fields(),
        )))
        .fetch_optional(&mut *conn)
        .await?;
    Ok(match row {
        Some(r) => Some(r.try_get("id")?),
        None => None,
    })
}

/// Statuses a process can be revised from: it no longer works (or waits for a person).
const REVISABLE: &[ProcessStatus] = &[
    ProcessStatus::Succeeded,
    ProcessStatus::Failed,
    ProcessStatus::Compensated,
    ProcessStatus::Cancelled,
    ProcessStatus::ManualReview,
];

/// Revises process `old` with a changed `input`: a new process (revision n+1 of the same kind and
/// business key, `revision_of` = `old`) of `definition`, never an edit of the old one. An old
/// process in manual_review is cancelled (reason recorded) in the same transaction; a process that
/// is still being worked cannot be revised.
pub async fn revise<'c, A, T>(
    conn: A,
    schema: &Schema,
    definition: &Definition,
    old: Uuid,
    input: &T,
    reason: &str,
    actor: &str,
) -> Result<Uuid, Error>
where
    A: Acquire<'c, Database = Postgres>,
    T: Serialize + ?Sized,
{
    let input = serde_json::to_value(input).map_err(Error::Input)?;
    crate::admin::check_reason_actor(reason, actor)?;
    let mut conn = conn.acquire().await?;
    let mut tx = conn.begin().await?;
    let row = sqlx::query(schema.sql(
        "SELECT kind, business_key, status FROM {{schema}}.processes WHERE id = $1 FOR UPDATE",
    ))
    .bind(old)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(Error::NotFound(old))?;
    let kind: String = row.try_get("kind")?;
    let business_key: String = row.try_get("business_key")?;
    let status: ProcessStatus = row.try_get("status")?;
    if kind != definition.kind() {
        return Err(Error::Invalid(format!(
            "process {old} is a {kind}, not a {}",
            definition.kind()
        )));
    }
    if !REVISABLE.contains(&status) {
        return Err(Error::NotAllowed {
            action: "revise".into(),
            why: format!("process is {status}; revise it once it stopped or waits for review"),
        });
    }
    let latest: i32 = sqlx::query_scalar(schema.sql(
        "SELECT max(revision) FROM {{schema}}.processes WHERE kind = $1 AND business_key = $2",
    ))
    .bind(&kind)
    .bind(&business_key)
    .fetch_one(&mut *tx)
    .await?;
    let why = redact::truncate(&format!("revision of {old}: {reason}"), 1000);
    let id = insert(
        &mut tx,
        schema,
        definition,
        &business_key,
        latest + 1,
        Some(old),
        &why,
        actor,
        &input,
    )
    .await?
    .ok_or_else(|| Error::NotAllowed {
        action: "revise".into(),
        why: "a concurrent revision was made; reload".into(),
    })?;
    if status == ProcessStatus::ManualReview {
        sqlx::query(schema.sql(
            "UPDATE {{schema}}.processes SET status = 'cancelled', finished_at = now(), updated_at = now(), \
             last_reason = $2, last_actor = $3 WHERE id = $1",
        ))
        .bind(old)
        .bind(redact::truncate(&format!("revised by {id}: {reason}"), 1000))
        .bind(actor)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<F: Send>(f: F) -> F {
        f
    }

    /// Compiles only if [`start_in`]'s future is `Send` for a transaction's connection, with an
    /// input that is not `Sync` and is gone before the future runs (it is serialized at the call).
    #[allow(dead_code)]
    async fn start_in_is_send(tx: &mut sqlx::Transaction<'_, Postgres>, definition: &Definition) {
        let schema = Schema::default();
        let fut = {
            let input = std::cell::Cell::new(5);
            assert_send(start_in(tx, &schema, definition, "k", &input))
        };
        let _ = fut.await;
    }

    #[test]
    fn an_invalid_key_or_input_is_refused_before_any_statement() {
        let d = Definition::new("k", 1);
        assert!(matches!(
            prepare(&d, "", &serde_json::json!({})),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            prepare(&d, &"x".repeat(501), &serde_json::json!({})),
            Err(Error::Invalid(_))
        ));
        let mut bad = std::collections::HashMap::new();
        bad.insert(vec![1u8], 1);
        assert!(matches!(prepare(&d, "k", &bad), Err(Error::Input(_))));
    }
}
