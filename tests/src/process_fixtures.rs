//! Test definitions for the process tests and the `process_worker` binary: an order process
//! (reserve locally, charge at a fake remote, confirm locally) whose remote honours keys, can be
//! queried, or neither; a fake remote recorded in the test database (schema `fake_remote`, its
//! own connections, so its effects commit independently of the process's checkpoints) that
//! counts every effect; and failpoints chosen by `PROCESS_FAILPOINT` that stop a worker at an
//! exact point so the test can SIGKILL it.
//!
//! Per-process behaviour comes from the input: `{"amount": 5, "card": "...", "charge": "...",
//! "reject_confirm": false}`, with `charge` one of `ok`, `timeout_once` (acts, then answers after
//! the step's timeout on the first attempt), `timeout_then_transient` (acts and answers too late
//! on the first attempt, then answers 503 without looking at the key on every later one),
//! `transient_always`, `permanent`.

use processes::{
    Action, Definition, Done, ExternalStep, LocalStep, Lookup, Registry, Remote, RetryPolicy, Step,
    StepContext, StepError, StepFuture,
};
use sqlx::{PgConnection, PgPool};
use std::time::Duration;

/// The kinds of the order process, one per remote capability.
pub const ORDER_KINDS: &[(&str, Remote)] = &[
    ("order_key", Remote::HonoursKey),
    ("order_query", Remote::Queryable),
    ("order_none", Remote::Neither),
];

/// Timeout of one charge attempt.
pub const CHARGE_TIMEOUT: Duration = Duration::from_millis(1500);

/// Creates the fake remote and the fake shop tables.
pub async fn setup(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(
        "CREATE SCHEMA IF NOT EXISTS fake_remote;
         CREATE TABLE IF NOT EXISTS fake_remote.charges (id bigserial PRIMARY KEY, process_id uuid NOT NULL,
             reference uuid NOT NULL, key text UNIQUE, amount bigint NOT NULL, refunded boolean NOT NULL DEFAULT false);
         CREATE TABLE IF NOT EXISTS fake_remote.refunds (id bigserial PRIMARY KEY, process_id uuid NOT NULL,
             charge text NOT NULL, key text UNIQUE);
         CREATE TABLE IF NOT EXISTS fake_remote.failpoints (name text PRIMARY KEY, worker text, at timestamptz DEFAULT now());
         CREATE TABLE IF NOT EXISTS fake_remote.flags (name text PRIMARY KEY);
         CREATE SCHEMA IF NOT EXISTS fake_shop;
         CREATE TABLE IF NOT EXISTS fake_shop.reservations (process_id uuid PRIMARY KEY, released boolean NOT NULL DEFAULT false);
         CREATE TABLE IF NOT EXISTS fake_shop.confirmations (process_id uuid PRIMARY KEY);",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Where to stop: `hang_before:<step>`, `hang_after_effect:<step>`, `stall_after_effect:<step>`
/// (waits for flag `release`), `hang_before_compensation:<step>`; `<step>` is a step name.
#[derive(Debug, Clone, Default)]
pub struct Failpoint {
    pub point: String,
    pub step: String,
    pub worker: String,
}

impl Failpoint {
    pub fn from_env(worker: &str) -> Self {
        let spec = std::env::var("PROCESS_FAILPOINT").unwrap_or_default();
        let (point, step) = spec.split_once(':').unwrap_or(("", ""));
        Self {
            point: point.to_string(),
            step: step.to_string(),
            worker: worker.to_string(),
        }
    }
    pub(crate) fn is(&self, point: &str, step: &str) -> bool {
        self.point == point && self.step == step
    }
    /// Records that the point was reached, then never returns (the test kills the worker).
    async fn hang(&self, pool: &PgPool, name: &str) -> ! {
        self.reached(pool, name).await;
        futures::future::pending::<()>().await;
        unreachable!()
    }
    async fn reached(&self, pool: &PgPool, name: &str) {
        eprintln!("FAILPOINT {name} reached by {}", self.worker);
        let _ = sqlx::query("INSERT INTO fake_remote.failpoints (name, worker) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(name)
            .bind(&self.worker)
            .execute(pool)
            .await;
    }
}

fn input_str<'a>(ctx: &'a StepContext, field: &str) -> &'a str {
    ctx.input
        .get(field)
        .and_then(|v| v.as_str())
        .unwrap_or("ok")
}

struct Reserve {
    pool: PgPool,
    fp: Failpoint,
}

impl LocalStep for Reserve {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            if self.fp.is("hang_before", "reserve") {
                self.fp.hang(&self.pool, "hang_before:reserve").await;
            }
            let amount = ctx
                .input
                .get("amount")
                .and_then(|v| v.as_i64())
                .unwrap_or(0);
            if amount <= 0 {
                return Err(StepError::permanent(format!("invalid amount {amount}")));
            }
            sqlx::query("INSERT INTO fake_shop.reservations (process_id) VALUES ($1)")
                .bind(ctx.process_id)
                .execute(&mut *tx)
                .await?;
            Ok(Done::new(format!("reservation:{}", ctx.process_id)))
        })
    }
}

struct Release {
    pool: PgPool,
    fp: Failpoint,
}

impl LocalStep for Release {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            if self.fp.is("hang_before_compensation", "reserve") {
                self.fp
                    .hang(&self.pool, "hang_before_compensation:reserve")
                    .await;
            }
            sqlx::query("UPDATE fake_shop.reservations SET released = true WHERE process_id = $1")
                .bind(ctx.process_id)
                .execute(&mut *tx)
                .await?;
            Ok(Done::new(format!("released:{}", ctx.process_id)))
        })
    }
}

struct Confirm {
    pool: PgPool,
    fp: Failpoint,
}

impl LocalStep for Confirm {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            if self.fp.is("hang_before", "confirm") {
                self.fp.hang(&self.pool, "hang_before:confirm").await;
            }
            if ctx
                .input
                .get("reject_confirm")
                .and_then(|v| v.as_bool())
                .unwrap_or(false)
            {
                return Err(StepError::permanent("order cannot be confirmed"));
            }
            let charge = ctx
                .references
                .get("charge")
                .map(String::as_str)
                .unwrap_or("");
            if !charge.starts_with("ch_") {
                return Err(StepError::permanent("no charge evidence"));
            }
            sqlx::query("INSERT INTO fake_shop.confirmations (process_id) VALUES ($1)")
                .bind(ctx.process_id)
                .execute(&mut *tx)
                .await?;
            Ok(Done::new(format!("confirmation:{}", ctx.process_id)))
        })
    }
}

/// The fake remote's charge: an effect row in its own transaction.
struct Charge {
    pool: PgPool,
    fp: Failpoint,
}

impl Charge {
    async fn effect(&self, ctx: &StepContext) -> Result<String, StepError> {
        let amount = ctx
            .input
            .get("amount")
            .and_then(|v| v.as_i64())
            .unwrap_or(0);
        let id: i64 = match &ctx.idempotency_key {
            // Honours the key: the same key returns the first charge.
            Some(key) => sqlx::query_scalar(
                "INSERT INTO fake_remote.charges (process_id, reference, key, amount) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (key) DO UPDATE SET key = EXCLUDED.key RETURNING id",
            )
            .bind(ctx.process_id)
            .bind(ctx.operation_id)
            .bind(key)
            .bind(amount)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| StepError::transient(format!("remote unreachable: {e}")))?,
            None => sqlx::query_scalar(
                "INSERT INTO fake_remote.charges (process_id, reference, amount) VALUES ($1, $2, $3) RETURNING id",
            )
            .bind(ctx.process_id)
            .bind(ctx.operation_id)
            .bind(amount)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| StepError::transient(format!("remote unreachable: {e}")))?,
        };
        Ok(format!("ch_{id}"))
    }
}

impl ExternalStep for Charge {
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done> {
        Box::pin(async move {
            if self.fp.is("hang_before", "charge") {
                self.fp.hang(&self.pool, "hang_before:charge").await;
            }
            match input_str(ctx, "charge") {
                "transient_always" => return Err(StepError::transient("HTTP 503")),
                "timeout_then_transient" if ctx.attempt > 1 => {
                    return Err(StepError::transient("HTTP 503"));
                }
                "permanent" => {
                    return Err(StepError::permanent(
                        "HTTP 402 declined card 4111111111111111",
                    ));
                }
                _ => {}
            }
            let id = self.effect(ctx).await?;
            if self.fp.is("hang_after_effect", "charge") {
                self.fp.hang(&self.pool, "hang_after_effect:charge").await;
            }
            if self.fp.is("stall_after_effect", "charge") {
                self.fp
                    .reached(&self.pool, "stall_after_effect:charge")
                    .await;
                loop {
                    let released: Option<String> = sqlx::query_scalar(
                        "SELECT name FROM fake_remote.flags WHERE name = 'release'",
                    )
                    .fetch_optional(&self.pool)
                    .await
                    .unwrap_or(None);
                    if released.is_some() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            if matches!(
                input_str(ctx, "charge"),
                "timeout_once" | "timeout_then_transient"
            ) && ctx.attempt == 1
            {
                tokio::time::sleep(CHARGE_TIMEOUT * 3).await;
            }
            Ok(Done::new(id.clone()).with_output(serde_json::json!({ "charge": id })))
        })
    }

    fn query<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Lookup> {
        Box::pin(async move {
            let id: Option<i64> = sqlx::query_scalar(
                "SELECT id FROM fake_remote.charges WHERE reference = $1 ORDER BY id LIMIT 1",
            )
            .bind(ctx.operation_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| StepError::transient(format!("remote unreachable: {e}")))?;
            Ok(match id {
                Some(id) => {
                    let r = format!("ch_{id}");
                    Lookup::Found(
                        Done::new(r.clone()).with_output(serde_json::json!({ "charge": r })),
                    )
                }
                None => Lookup::NotFound,
            })
        })
    }
}

/// The refund of a charge (always keyed).
struct Refund {
    pool: PgPool,
    fp: Failpoint,
}

impl ExternalStep for Refund {
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done> {
        Box::pin(async move {
            if self.fp.is("hang_before_compensation", "charge") {
                self.fp
                    .hang(&self.pool, "hang_before_compensation:charge")
                    .await;
            }
            let charge = ctx
                .compensates
                .as_ref()
                .map(|d| d.reference.clone())
                .unwrap_or_default();
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO fake_remote.refunds (process_id, charge, key) VALUES ($1, $2, $3) \
                 ON CONFLICT (key) DO UPDATE SET key = EXCLUDED.key RETURNING id",
            )
            .bind(ctx.process_id)
            .bind(&charge)
            .bind(ctx.operation_id.to_string())
            .fetch_one(&self.pool)
            .await
            .map_err(|e| StepError::transient(format!("remote unreachable: {e}")))?;
            if self.fp.is("hang_after_compensation_effect", "charge") {
                self.fp
                    .hang(&self.pool, "hang_after_compensation_effect:charge")
                    .await;
            }
            Ok(Done::new(format!("re_{id}")))
        })
    }
}

/// The fake steps of the order definitions, each over the same pool and failpoint.
struct Fakes<'a> {
    pool: &'a PgPool,
    fp: &'a Failpoint,
}

impl Fakes<'_> {
    /// One fake step (or compensation), made of the shared pool and failpoint.
    fn make<T>(&self, fake: fn(PgPool, Failpoint) -> T) -> T {
        fake(self.pool.clone(), self.fp.clone())
    }

    /// The reserve step, released when compensated (as every order definition has it).
    fn reserve_step(&self) -> Step {
        Step::local("reserve", self.make(|pool, fp| Reserve { pool, fp }))
            .compensate(Action::local(self.make(|pool, fp| Release { pool, fp })))
    }
}

/// The order process of `kind` whose charge's remote is `remote`, at `version`.
pub fn order(
    kind: &str,
    remote: Remote,
    version: i32,
    pool: &PgPool,
    fp: &Failpoint,
) -> Definition {
    let fakes = Fakes { pool, fp };
    let retry = RetryPolicy::default()
        .initial(Duration::from_millis(50))
        .max_delay(Duration::from_millis(200))
        .max_attempts(4)
        .deadline(Some(Duration::from_secs(60)));
    Definition::new(kind, version)
        .redact("card")
        .step(
            Step::local("reserve", fakes.make(|pool, fp| Reserve { pool, fp }))
                .retry(retry)
                .compensate(Action::local(fakes.make(|pool, fp| Release { pool, fp }))),
        )
        .step(
            Step::external("charge", remote, fakes.make(|pool, fp| Charge { pool, fp }))
                .retry(retry)
                .timeout(CHARGE_TIMEOUT)
                .compensate(Action::external(
                    Remote::HonoursKey,
                    fakes.make(|pool, fp| Refund { pool, fp }),
                )),
        )
        .step(Step::local("confirm", fakes.make(|pool, fp| Confirm { pool, fp })).retry(retry))
}

/// Like [`order`] with a charge retried for at most `deadline` (many attempts allowed).
pub fn order_with_deadline(
    kind: &str,
    deadline: Duration,
    pool: &PgPool,
    fp: &Failpoint,
) -> Definition {
    let fakes = Fakes { pool, fp };
    let retry = RetryPolicy::default()
        .initial(Duration::from_millis(50))
        .max_delay(Duration::from_millis(100))
        .max_attempts(1000)
        .deadline(Some(deadline));
    Definition::new(kind, 1).step(fakes.reserve_step()).step(
        Step::external(
            "charge",
            Remote::HonoursKey,
            fakes.make(|pool, fp| Charge { pool, fp }),
        )
        .retry(retry),
    )
}

/// Like [`order`] whose charge's refund is sensitive (waits for approval).
pub fn order_sensitive_refund(kind: &str, pool: &PgPool, fp: &Failpoint) -> Definition {
    let fakes = Fakes { pool, fp };
    Definition::new(kind, 1)
        .money("amount", "currency")
        .step(fakes.reserve_step())
        .step(
            Step::external(
                "charge",
                Remote::HonoursKey,
                fakes.make(|pool, fp| Charge { pool, fp }),
            )
            .compensate_sensitive(Action::external(
                Remote::HonoursKey,
                fakes.make(|pool, fp| Refund { pool, fp }),
            )),
        )
        .step(Step::local(
            "confirm",
            fakes.make(|pool, fp| Confirm { pool, fp }),
        ))
}

/// Every order kind at version 1.
pub fn registry(pool: &PgPool, fp: &Failpoint) -> Registry {
    let mut r = Registry::new();
    for (kind, remote) in ORDER_KINDS {
        r = r
            .with(order(kind, *remote, 1, pool, fp))
            .expect("valid definition");
    }
    r = r
        .with(order_sensitive_refund("order_sensitive", pool, fp))
        .expect("valid definition");
    let version: i32 = std::env::var("PROCESS_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let r = r
        .with(versioned(version, pool, fp))
        .expect("valid definition");
    crate::wait_fixtures::register(r, pool, fp)
}

/// Kind `versioned`: version 1 is the order process; version 2 adds a final `audit` step.
pub fn versioned(version: i32, pool: &PgPool, fp: &Failpoint) -> Definition {
    let d = order("versioned", Remote::HonoursKey, version, pool, fp);
    if version >= 2 {
        d.step(Step::local("audit", Audit))
    } else {
        d
    }
}

struct Audit;

impl LocalStep for Audit {
    fn run<'a>(&'a self, ctx: &'a StepContext, _tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move { Ok(Done::new(format!("audited:{}", ctx.process_id))) })
    }
}

/// Effects the fake remote recorded for a process: (charges, refunds).
pub async fn effects(pool: &PgPool, process: uuid::Uuid) -> (i64, i64) {
    let charges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fake_remote.charges WHERE process_id = $1")
            .bind(process)
            .fetch_one(pool)
            .await
            .unwrap_or(-1);
    let refunds: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fake_remote.refunds WHERE process_id = $1")
            .bind(process)
            .fetch_one(pool)
            .await
            .unwrap_or(-1);
    (charges, refunds)
}

/// A one-step process's step that does nothing: for measuring the worker's claims and
/// checkpoints alone (`plans`, `bench old-snapshot`).
pub struct Noop;

impl LocalStep for Noop {
    fn run<'a>(&'a self, _: &'a StepContext, _: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async { Ok(Done::new("done")) })
    }
}
