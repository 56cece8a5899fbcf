//! Test definitions with steps that wait, for `process_waits.rs` and the `process_worker` binary:
//!
//! - `await_query` / `await_none`: `charge` (local: its output names the charge, from the input's
//!   `charge_id`), `confirmation` (waits for the event `charge:<id>`, deadline from the input's
//!   absence: 60 s, or 1 s for the `_short` kinds), `record` (local: a row in
//!   `fake_shop.confirmations`). `await_query` asks `fake_remote.outcomes` at the deadline
//!   (`succeeded` = found, `failed` = declined for good, `pending` = still unknown, no row =
//!   not found); `await_none` cannot ask.
//! - `timer`: `timer` (continues `delay_ms` after it is first reached), then `record`.
//!
//! Failpoint `die_on:received` aborts the worker the moment it takes a woken wait's event, before
//! anything of it is stored.

use crate::process_fixtures::Failpoint;
use chrono::Utc;
use processes::{
    Definition, Done, LocalStep, Lookup, Registry, Remote, RetryPolicy, Step, StepContext,
    StepError, StepFuture, WaitStep,
};
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};
use std::time::Duration;

/// (kind, remote, deadline) of the waiting kinds.
pub const WAIT_KINDS: &[(&str, Remote, Duration)] = &[
    ("await_query", Remote::Queryable, Duration::from_secs(60)),
    ("await_none", Remote::Neither, Duration::from_secs(60)),
    (
        "await_query_short",
        Remote::Queryable,
        Duration::from_secs(1),
    ),
    ("await_none_short", Remote::Neither, Duration::from_secs(1)),
];

/// The outcomes table the queryable remote answers from.
pub async fn setup(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS fake_remote.outcomes (charge text PRIMARY KEY, status text NOT NULL,
             queried integer NOT NULL DEFAULT 0);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The correlation key of a charge.
pub fn key(charge: &str) -> String {
    format!("charge:{charge}")
}

struct Charge;

impl LocalStep for Charge {
    fn run<'a>(&'a self, ctx: &'a StepContext, _tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            let id = ctx
                .input
                .get("charge_id")
                .and_then(Value::as_str)
                .ok_or_else(|| StepError::permanent("no charge_id in the input"))?;
            Ok(Done::new(id).with_output(json!({"charge_id": id})))
        })
    }
}

struct Confirmation {
    pool: PgPool,
    fp: Failpoint,
}

impl WaitStep for Confirmation {
    fn key(&self, ctx: &StepContext) -> Result<String, StepError> {
        ctx.outputs
            .get("charge")
            .and_then(|o| o.get("charge_id"))
            .and_then(Value::as_str)
            .map(key)
            .ok_or_else(|| StepError::permanent("the charge step left no charge_id"))
    }

    fn received(&self, _ctx: &StepContext, key: &str, payload: &Value) -> Result<Done, StepError> {
        if self.fp.is("die_on", "received") {
            eprintln!("FAILPOINT die_on:received reached by {}", self.fp.worker);
            std::process::abort();
        }
        match payload.get("status").and_then(Value::as_str) {
            Some("succeeded") => Ok(Done::new(key).with_output(payload.clone())),
            Some("failed") => Err(StepError::permanent("the charge was declined")),
            other => Err(StepError::permanent(format!(
                "unexpected event status {other:?}"
            ))),
        }
    }

    fn query<'a>(&'a self, _ctx: &'a StepContext, key: &'a str) -> StepFuture<'a, Lookup> {
        Box::pin(async move {
            let charge = key.trim_start_matches("charge:");
            let status: Option<String> = sqlx::query_scalar(
                "UPDATE fake_remote.outcomes SET queried = queried + 1 WHERE charge = $1 RETURNING status",
            )
            .bind(charge)
            .fetch_optional(&self.pool)
            .await?;
            match status.as_deref() {
                Some("succeeded") => Ok(Lookup::Found(
                    Done::new(key).with_output(json!({"status": "succeeded", "via": "query"})),
                )),
                Some("failed") => Err(StepError::permanent("declined (status query)")),
                Some(_) => Err(StepError::unknown("still pending")),
                None => Ok(Lookup::NotFound),
            }
        })
    }
}

struct Record;

impl LocalStep for Record {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            sqlx::query("INSERT INTO fake_shop.confirmations (process_id) VALUES ($1)")
                .bind(ctx.process_id)
                .execute(&mut *tx)
                .await?;
            Ok(Done::new(format!("confirmation:{}", ctx.process_id)))
        })
    }
}

/// A waiting kind of [`WAIT_KINDS`].
pub fn awaiting(
    kind: &str,
    remote: Remote,
    deadline: Duration,
    pool: &PgPool,
    fp: &Failpoint,
) -> Definition {
    Definition::new(kind, 1)
        .step(Step::local("charge", Charge))
        .step(
            Step::wait(
                "confirmation",
                remote,
                deadline,
                Confirmation {
                    pool: pool.clone(),
                    fp: fp.clone(),
                },
            )
            .retry(
                RetryPolicy::default()
                    .max_attempts(4)
                    .initial(Duration::from_millis(300)),
            )
            .timeout(Duration::from_secs(5)),
        )
        .step(Step::local("record", Record))
}

/// Kind `timer`: continues `delay_ms` (input) after it first reaches its timer.
pub fn timer() -> Definition {
    Definition::new("timer", 1)
        .step(Step::timer("timer", |ctx: &StepContext| {
            let ms = ctx
                .input
                .get("delay_ms")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            Ok(Utc::now() + chrono::Duration::milliseconds(ms))
        }))
        .step(Step::local("record", Record))
}

/// Adds the waiting kinds to `r`.
pub fn register(mut r: Registry, pool: &PgPool, fp: &Failpoint) -> Registry {
    for (kind, remote, deadline) in WAIT_KINDS {
        r = r
            .with(awaiting(kind, *remote, *deadline, pool, fp))
            .expect("valid definition");
    }
    r.with(timer()).expect("valid definition")
}
