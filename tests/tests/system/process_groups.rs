//! Consecutive local steps of one process run in one transaction (a local group): every effect
//! commits with its own checkpoint or not at all, a step that fails inside a group leaves the
//! steps before it committed once, and a group whose lease was taken over commits nothing.
//! A claimed process whose rows cannot be read is skipped without holding up the others.
//! In-process workers against the real PostgreSQL.

use processes::{
    Action, Definition, Done, LocalStep, Registry, Step, StepContext, StepError, StepFuture,
    Worker, WorkerConfig,
};
use serde_json::json;
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use system_tests::{TestDb, init_logging, wait_until};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// What a step does, from the input: `{"fail": "<step>", "how": "permanent" | "transient_once"}`
/// makes that step fail (permanently, or transiently on its first recorded attempt).
#[derive(Clone, Default)]
struct Probe {
    /// Runs of each step's code (committed or not).
    runs: Arc<AtomicU32>,
    /// Step `b` waits here when the input says `{"hold": true}`, after saying so on `held`.
    held: Arc<Notify>,
    release: Arc<Notify>,
}

struct Effect {
    name: &'static str,
    probe: Probe,
}

impl LocalStep for Effect {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            self.probe.runs.fetch_add(1, Ordering::SeqCst);
            sqlx::query("INSERT INTO grp.effects (process_id, step) VALUES ($1, $2)")
                .bind(ctx.process_id)
                .bind(self.name)
                .execute(&mut *tx)
                .await?;
            if self.name == "b" && ctx.input["hold"] == json!(true) {
                self.probe.held.notify_one();
                self.probe.release.notified().await;
            }
            if ctx.input["fail"] == json!(self.name) {
                match ctx.input["how"].as_str() {
                    Some("transient_once") if ctx.attempt == 1 => {
                        return Err(StepError::transient("busy, try again"));
                    }
                    Some("permanent") => return Err(StepError::permanent("refused")),
                    _ => {}
                }
            }
            // Later steps of a group see the earlier ones' outputs.
            let seen: Vec<&String> = ctx.outputs.keys().collect();
            Ok(Done::new(format!("{}:{}", self.name, ctx.process_id))
                .with_output(json!({ "saw": seen.len() })))
        })
    }
}

struct Undo;

impl LocalStep for Undo {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move {
            sqlx::query("INSERT INTO grp.effects (process_id, step) VALUES ($1, 'undo_a')")
                .bind(ctx.process_id)
                .execute(&mut *tx)
                .await?;
            Ok(Done::new("undone"))
        })
    }
}

fn definition(probe: &Probe) -> Definition {
    let step = |name| Effect {
        name,
        probe: probe.clone(),
    };
    Definition::new("grouped", 1)
        .step(Step::local("a", step("a")).compensate(Action::local(Undo)))
        .step(Step::local("b", step("b")))
        .step(Step::local("c", step("c")))
}

async fn setup() -> TestDb {
    init_logging();
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE SCHEMA grp;
         CREATE TABLE grp.effects (id bigserial PRIMARY KEY, process_id uuid NOT NULL, step text NOT NULL);",
    )
    .execute(&db.pool)
    .await
    .expect("effects table");
    db
}

async fn start(pool: &PgPool, probe: &Probe, key: &str, input: serde_json::Value) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let started = processes::start_in(&mut tx, &Schema::default(), &definition(probe), key, &input)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    started.id
}

fn worker(pool: &PgPool, probe: &Probe) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let mut config = WorkerConfig::new(pool.clone(), Schema::default(), "grouper");
    config.lease = Duration::from_secs(30);
    config.heartbeat = Duration::from_secs(10);
    config.poll_interval = Duration::from_millis(100);
    let registry = Registry::new().with(definition(probe)).unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let handle = tokio::spawn(async move {
        Worker::run(config, registry, s).await.expect("worker runs");
    });
    (stop, handle)
}

async fn wait_status(pool: &PgPool, id: Uuid, want: &str) {
    wait_until(&format!("process {want}"), WAIT, || async {
        let s: String = sqlx::query_scalar("SELECT status FROM outbox.processes WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .ok()?;
        (s == want).then_some(())
    })
    .await;
}

/// Starts process `key` with `input`, runs a worker until the process is `want`, then stops the
/// worker; returns the process id.
async fn run_until(
    pool: &PgPool,
    probe: &Probe,
    key: &str,
    input: serde_json::Value,
    want: &str,
) -> Uuid {
    let id = start(pool, probe, key, input).await;
    let (stop, handle) = worker(pool, probe);
    wait_status(pool, id, want).await;
    stop.cancel();
    handle.await.unwrap();
    id
}

async fn effects(pool: &PgPool, id: Uuid) -> Vec<String> {
    sqlx::query_scalar("SELECT step FROM grp.effects WHERE process_id = $1 ORDER BY id")
        .bind(id)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// (name, role, status, attempts) of every step, in order.
async fn steps(pool: &PgPool, id: Uuid) -> Vec<(String, String, String, i32)> {
    sqlx::query_as(
        "SELECT name, role, status, attempts FROM outbox.process_steps WHERE process_id = $1 ORDER BY seq",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// (step seq, from, to, reason) of every step transition, in order.
async fn step_history(pool: &PgPool, id: Uuid) -> Vec<(i32, Option<String>, String, String)> {
    sqlx::query_as(
        "SELECT step_seq, from_status, to_status, reason FROM outbox.process_history \
         WHERE process_id = $1 AND step_seq IS NOT NULL ORDER BY id",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Steps a, b and c all still pending, never attempted: the group committed nothing.
async fn assert_no_step_ran(pool: &PgPool, id: Uuid) {
    assert_eq!(
        steps(pool, id).await,
        [
            row("a", "forward", "pending", 0),
            row("b", "forward", "pending", 0),
            row("c", "forward", "pending", 0),
        ]
    );
}

/// The process is running under the lease of `owner`.
async fn assert_running_under(pool: &PgPool, id: Uuid, owner: &str) {
    let (status, lease_owner): (String, Option<String>) =
        sqlx::query_as("SELECT status, lease_owner FROM outbox.processes WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), lease_owner.as_deref()),
        ("running", Some(owner))
    );
}

fn row(name: &str, role: &str, status: &str, attempts: i32) -> (String, String, String, i32) {
    (name.into(), role.into(), status.into(), attempts)
}

#[tokio::test]
async fn three_local_steps_commit_in_one_transaction_each_with_its_checkpoint_and_history() {
    let db = setup().await;
    let probe = Probe::default();
    let id = run_until(&db.pool, &probe, "all-ok", json!({}), "succeeded").await;

    assert_eq!(effects(&db.pool, id).await, ["a", "b", "c"]);
    assert_eq!(probe.runs.load(Ordering::SeqCst), 3, "each step ran once");
    assert_eq!(
        steps(&db.pool, id).await,
        [
            row("a", "forward", "succeeded", 1),
            row("b", "forward", "succeeded", 1),
            row("c", "forward", "succeeded", 1),
        ]
    );
    // One transaction: the checkpoints carry one commit's timestamp and the claim's token.
    let (finished, tokens): (i64, i64) = sqlx::query_as(
        "SELECT count(DISTINCT s.finished_at), count(DISTINCT s.lease_token) FROM outbox.process_steps s \
         JOIN outbox.processes p ON p.id = s.process_id WHERE s.process_id = $1 AND s.lease_token = p.lease_token",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((finished, tokens), (1, 1));
    // Every transition is in the history with its reason; the last step saw both outputs before it.
    assert_eq!(
        step_history(&db.pool, id).await,
        [
            (
                0,
                Some("pending".into()),
                "succeeded".into(),
                "succeeded".into()
            ),
            (
                1,
                Some("pending".into()),
                "succeeded".into(),
                "succeeded".into()
            ),
            (
                2,
                Some("pending".into()),
                "succeeded".into(),
                "succeeded".into()
            ),
        ]
    );
    let saw: serde_json::Value = sqlx::query_scalar(
        "SELECT output FROM outbox.process_steps WHERE process_id = $1 AND name = 'c'",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(saw, json!({"saw": 2}));
    let reason: String =
        sqlx::query_scalar("SELECT last_reason FROM outbox.processes WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "every step succeeded");
    db.pool.close().await;
}

#[tokio::test]
async fn a_step_failing_inside_a_group_leaves_the_steps_before_it_committed_once() {
    let db = setup().await;
    let probe = Probe::default();
    let id = run_until(
        &db.pool,
        &probe,
        "b-permanent",
        json!({"fail": "b", "how": "permanent"}),
        "compensated",
    )
    .await;

    // a's effect committed once (its code ran twice: in the rolled-back group, then alone), b's
    // never, c never ran; a was compensated.
    assert_eq!(effects(&db.pool, id).await, ["a", "undo_a"]);
    assert_eq!(
        steps(&db.pool, id).await,
        [
            row("a", "forward", "succeeded", 1),
            row("b", "forward", "failed", 1),
            row("c", "forward", "pending", 0),
            row("a", "compensation", "succeeded", 1),
        ]
    );
    let history = step_history(&db.pool, id).await;
    assert!(
        history
            .iter()
            .any(|(seq, _, to, reason)| *seq == 1 && to == "failed" && reason.contains("refused")),
        "b's failure and its reason are recorded: {history:?}"
    );
    db.pool.close().await;
}

#[tokio::test]
async fn a_transient_failure_inside_a_group_is_retried_and_nothing_runs_twice_committed() {
    let db = setup().await;
    let probe = Probe::default();
    let id = run_until(
        &db.pool,
        &probe,
        "c-transient",
        json!({"fail": "c", "how": "transient_once"}),
        "succeeded",
    )
    .await;

    assert_eq!(effects(&db.pool, id).await, ["a", "b", "c"]);
    assert_eq!(
        steps(&db.pool, id).await,
        [
            row("a", "forward", "succeeded", 1),
            row("b", "forward", "succeeded", 1),
            row("c", "forward", "succeeded", 2),
        ]
    );
    let history = step_history(&db.pool, id).await;
    let c: Vec<(&str, &str)> = history
        .iter()
        .filter(|(seq, ..)| *seq == 2)
        .map(|(_, from, to, _)| (from.as_deref().unwrap_or(""), to.as_str()))
        .collect();
    assert_eq!(c, [("pending", "retryable"), ("retryable", "succeeded")]);
    db.pool.close().await;
}

#[tokio::test]
async fn a_group_whose_lease_was_taken_over_meanwhile_commits_nothing() {
    let db = setup().await;
    let probe = Probe::default();
    let id = start(&db.pool, &probe, "taken-over", json!({"hold": true})).await;
    let (stop, handle) = worker(&db.pool, &probe);
    // b holds the group's transaction open (a's and b's effects done, uncommitted) ...
    tokio::time::timeout(WAIT, probe.held.notified())
        .await
        .expect("step b reached");
    // ... while another owner takes the process over (a new claim: a new token).
    sqlx::query(
        "UPDATE outbox.processes SET lease_owner = 'other', lease_token = nextval('outbox.process_lease_tokens'), \
         last_reason = 'taken over by other' WHERE id = $1",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();
    probe.release.notify_one();
    // The worker finishes its turn (c runs, the checkpoint is fenced) before it stops.
    stop.cancel();
    handle.await.unwrap();

    assert_eq!(probe.runs.load(Ordering::SeqCst), 3, "a, b and c ran");
    assert!(
        effects(&db.pool, id).await.is_empty(),
        "no effect of the fenced group committed"
    );
    assert_no_step_ran(&db.pool, id).await;
    assert!(step_history(&db.pool, id).await.is_empty());
    assert_running_under(&db.pool, id, "other").await;
    db.pool.close().await;
}

/// The race the finishing checkpoint's own fence is for: the takeover is not committed yet when
/// the group's checkpoint reads the token (still ours), and commits while the checkpoint waits for
/// the process row. The process update re-checks the token on the row the takeover committed and
/// matches nothing, so the whole group rolls back.
#[tokio::test]
async fn a_takeover_committed_while_the_finishing_checkpoint_waits_for_the_row_commits_nothing() {
    let db = setup().await;
    let probe = Probe::default();
    let id = start(&db.pool, &probe, "raced", json!({"hold": true})).await;
    let (stop, handle) = worker(&db.pool, &probe);
    tokio::time::timeout(WAIT, probe.held.notified())
        .await
        .expect("step b reached");
    // Another owner takes the process over, in a transaction still open: it holds the row.
    let mut takeover = db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE outbox.processes SET lease_owner = 'other', lease_token = nextval('outbox.process_lease_tokens'), \
         last_reason = 'taken over by other' WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *takeover)
    .await
    .unwrap();
    probe.release.notify_one();
    let pool = db.pool.clone();
    wait_until(
        "the group's checkpoint waits for the process row",
        WAIT,
        || {
            let pool = pool.clone();
            async move {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                (waiting > 0).then_some(())
            }
        },
    )
    .await;
    takeover.commit().await.unwrap();
    stop.cancel();
    handle.await.unwrap();

    assert_eq!(probe.runs.load(Ordering::SeqCst), 3, "a, b and c ran");
    assert!(
        effects(&db.pool, id).await.is_empty(),
        "no effect of the fenced group committed"
    );
    assert_no_step_ran(&db.pool, id).await;
    assert_running_under(&db.pool, id, "other").await;
    db.pool.close().await;
}

#[tokio::test]
async fn a_claimed_process_whose_steps_cannot_be_read_holds_up_no_other() {
    let db = setup().await;
    let probe = Probe::default();
    let poisoned = start(&db.pool, &probe, "poisoned", json!({})).await;
    // A timestamp the worker cannot represent: its claim returns the row, the worker skips it.
    sqlx::query(
        "UPDATE outbox.process_steps SET status = 'retryable', error_class = 'transient', \
         next_attempt_at = 'infinity', last_reason = 'test: unreadable' WHERE process_id = $1 AND seq = 1",
    )
    .bind(poisoned)
    .execute(&db.pool)
    .await
    .unwrap();
    let fine = run_until(&db.pool, &probe, "fine", json!({}), "succeeded").await;
    assert_eq!(effects(&db.pool, fine).await, ["a", "b", "c"]);
    assert!(effects(&db.pool, poisoned).await.is_empty());
    db.pool.close().await;
}
