//! Process steps that wait, against the real PostgreSQL: an event kept for a process that has not
//! reached its wait, the wake-up committed (or rolled back) with the caller's transaction, the
//! deadline followed by a status query or manual review, workers killed while a process waits and
//! at the moment of its wake-up, a timer across a restart, and what 100,000 waiting processes
//! cost.

use processes::{Registry, WorkerConfig};
use serde_json::json;
use shared::schema::Schema;
use sqlx::{PgPool, Row};
use std::time::{Duration, Instant};
use system_tests::process_fixtures::{self as fx, Failpoint};
use system_tests::wait_fixtures::{self as wf, key};
use system_tests::workers::{ChildWorker, InProcessWorker, status, wait_status};
use system_tests::{TestDb, init_logging, wait_until};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

async fn setup() -> TestDb {
    init_logging();
    let db = TestDb::new().await;
    fx::setup(&db.pool).await.expect("fake remote");
    wf::setup(&db.pool).await.expect("outcomes");
    db
}

fn schema() -> Schema {
    Schema::default()
}

fn registry(pool: &PgPool) -> Registry {
    wf::register(Registry::new(), pool, &Failpoint::default())
}

fn def(pool: &PgPool, kind: &str) -> processes::Definition {
    let (k, remote, deadline) = wf::WAIT_KINDS
        .iter()
        .find(|(k, _, _)| *k == kind)
        .expect("a waiting kind");
    wf::awaiting(k, *remote, *deadline, pool, &Failpoint::default())
}

async fn start(pool: &PgPool, kind: &str, charge: &str) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let s = processes::start(
        &mut *tx,
        &def(pool, kind),
        charge,
        &json!({"charge_id": charge}),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    s.id
}

/// Signals `charge`'s outcome in its own transaction, committed.
async fn signal(pool: &PgPool, charge: &str, status: &str) -> processes::Signalled {
    let mut tx = pool.begin().await.unwrap();
    let s = processes::signal(
        &mut tx,
        &schema(),
        &key(charge),
        &json!({"status": status}),
        &format!("test:{charge}"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    s
}

/// The process is parked at its wait: status waiting, no lease, the step running with its key.
async fn wait_parked(pool: &PgPool, id: Uuid) {
    let p = pool.clone();
    wait_until(&format!("process {id} parked at its wait"), WAIT, || {
        let p = p.clone();
        async move {
            let r = sqlx::query(
                "SELECT p.status, p.lease_owner, s.status AS step, s.wait_key, s.wait_until
                 FROM outbox.processes p JOIN outbox.process_steps s ON s.process_id = p.id
                 WHERE p.id = $1 AND s.execution IN ('wait', 'timer')",
            )
            .bind(id)
            .fetch_one(&p)
            .await
            .unwrap();
            let parked = r.get::<String, _>("status") == "waiting"
                && r.get::<Option<String>, _>("lease_owner").is_none()
                && r.get::<String, _>("step") == "running"
                && r.get::<Option<chrono::DateTime<chrono::Utc>>, _>("wait_until")
                    .is_some();
            parked.then_some(())
        }
    })
    .await;
}

async fn confirmations(pool: &PgPool, id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM fake_shop.confirmations WHERE process_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// (status, attempts, remote_ref, last_reason) of the wait step.
async fn wait_step(pool: &PgPool, id: Uuid) -> (String, i32, Option<String>, String) {
    let r = sqlx::query(
        "SELECT status, attempts, remote_ref, last_reason FROM outbox.process_steps
         WHERE process_id = $1 AND name = 'confirmation'",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    (
        r.get("status"),
        r.get("attempts"),
        r.get("remote_ref"),
        r.get("last_reason"),
    )
}

#[tokio::test]
async fn an_event_before_the_wait_is_kept_and_taken_when_the_process_gets_there() {
    let db = setup().await;
    let s = signal(&db.pool, "early", "succeeded").await;
    assert!(s.stored && s.woken.is_empty(), "{s:?}");
    let again = signal(&db.pool, "early", "failed").await;
    assert!(!again.stored, "the first event for a key wins: {again:?}");
    let id = start(&db.pool, "await_none", "early").await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_status(&db.pool, id, "succeeded").await;
    w.stop().await;
    let (st, attempts, reference, reason) = wait_step(&db.pool, id).await;
    assert_eq!(st, "succeeded");
    assert_eq!(attempts, 0, "it never had to wait");
    assert_eq!(reference.as_deref(), Some("charge:early"));
    assert!(reason.contains("event charge:early received"), "{reason}");
    assert_eq!(confirmations(&db.pool, id).await, 1);
    db.pool.close().await;
}

#[tokio::test]
async fn the_wake_up_commits_with_the_callers_transaction_and_a_rollback_wakes_nothing() {
    let db = setup().await;
    let id = start(&db.pool, "await_none", "c1").await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_parked(&db.pool, id).await;

    // The caller's transaction rolls back: no event, no wake-up.
    let mut tx = db.pool.begin().await.unwrap();
    let s = processes::signal(
        &mut tx,
        &schema(),
        &key("c1"),
        &json!({"status": "succeeded"}),
        "test",
    )
    .await
    .unwrap();
    assert_eq!(s.woken, vec![id], "the signal finds the waiting process");
    tx.rollback().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(status(&db.pool, id).await, "waiting");
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.process_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(events, 0);

    // Committed together with the caller's own row.
    sqlx::raw_sql("CREATE TABLE fake_shop.inbox (id text PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let woken_at = Instant::now();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO fake_shop.inbox (id) VALUES ('evt_1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let s = processes::signal(
        &mut tx,
        &schema(),
        &key("c1"),
        &json!({"status": "succeeded"}),
        "webhook:evt_1",
    )
    .await
    .unwrap();
    assert!(s.stored);
    tx.commit().await.unwrap();
    wait_status(&db.pool, id, "succeeded").await;
    eprintln!("wake-up to succeeded: {:?}", woken_at.elapsed());
    w.stop().await;
    assert_eq!(confirmations(&db.pool, id).await, 1);
    let (_, attempts, reference, _) = wait_step(&db.pool, id).await;
    assert_eq!((attempts, reference.as_deref()), (1, Some("charge:c1")));
    db.pool.close().await;
}

#[tokio::test]
async fn at_the_deadline_the_remote_is_queried_and_neither_goes_to_manual_review() {
    let db = setup().await;
    sqlx::query("INSERT INTO fake_remote.outcomes (charge, status) VALUES ('paid', 'pending'), ('declined', 'failed')")
        .execute(&db.pool)
        .await
        .unwrap();
    let paid = start(&db.pool, "await_query_short", "paid").await;
    let declined = start(&db.pool, "await_query_short", "declined").await;
    let unknown = start(&db.pool, "await_query_short", "unknown").await;
    let blind = start(&db.pool, "await_none_short", "blind").await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    // "pending" at the provider is an unknown outcome: queried again with backoff.
    let p = db.pool.clone();
    wait_until("a second query of the pending charge", WAIT, || {
        let p = p.clone();
        async move {
            let n: i32 = sqlx::query_scalar(
                "SELECT queried FROM fake_remote.outcomes WHERE charge = 'paid'",
            )
            .fetch_one(&p)
            .await
            .unwrap();
            (n >= 2).then_some(())
        }
    })
    .await;
    assert_eq!(wait_step(&db.pool, paid).await.0, "retryable");
    sqlx::query("UPDATE fake_remote.outcomes SET status = 'succeeded' WHERE charge = 'paid'")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_status(&db.pool, paid, "succeeded").await;
    wait_status(&db.pool, declined, "failed").await;
    wait_status(&db.pool, unknown, "manual_review").await;
    wait_status(&db.pool, blind, "manual_review").await;
    w.stop().await;

    let (_, _, reference, reason) = wait_step(&db.pool, paid).await;
    assert_eq!(reference.as_deref(), Some("charge:paid"));
    assert!(reason.contains("status query found"), "{reason}");
    assert_eq!(confirmations(&db.pool, paid).await, 1);
    assert_eq!(confirmations(&db.pool, declined).await, 0);
    assert_eq!(wait_step(&db.pool, declined).await.0, "failed");
    let (st, _, _, reason) = wait_step(&db.pool, unknown).await;
    assert_eq!(st, "manual_review");
    assert!(reason.contains("no record"), "{reason}");
    let (st, _, _, reason) = wait_step(&db.pool, blind).await;
    assert_eq!(st, "manual_review");
    assert!(reason.contains("cannot be queried"), "{reason}");
    let blind_queries: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fake_remote.outcomes WHERE charge = 'blind'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(blind_queries, 0);
    db.pool.close().await;
}

fn operator(
    action: processes::admin::Action,
    seen_version: i64,
    remote_check: Option<processes::admin::RemoteCheck>,
    approved_by: Option<&str>,
) -> processes::admin::Request {
    processes::admin::Request {
        action,
        reason: "the customer called".into(),
        seen_version,
        actor: "alice".into(),
        evidence: None,
        remote_check,
        approved_by: approved_by.map(String::from),
    }
}

/// An operator acts on a parked wait through the audited process actions: "query now" asks a
/// queryable remote at once (not at the deadline an hour away); a remote that cannot be queried
/// offers no query, and resolving the wait as failed needs what was checked at the remote and a
/// second person, as any step whose outcome is unknown. An event that comes after changes nothing.
#[tokio::test]
async fn an_operator_queries_a_parked_wait_now_or_resolves_it_with_evidence() {
    use processes::admin::{Action, RemoteCheck};
    let db = setup().await;
    sqlx::query("INSERT INTO fake_remote.outcomes (charge, status) VALUES ('asked', 'succeeded')")
        .execute(&db.pool)
        .await
        .unwrap();
    let asked = start(&db.pool, "await_query", "asked").await;
    let blind = start(&db.pool, "await_none", "blind").await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_parked(&db.pool, asked).await;
    wait_parked(&db.pool, blind).await;

    let view = processes::admin::get(&db.pool, &schema(), asked)
        .await
        .unwrap();
    let step = view
        .steps
        .iter()
        .find(|s| s.is_waiting())
        .expect("the parked wait");
    assert_eq!(step.wait_key.as_deref(), Some("charge:asked"));
    assert!(step.wait_since.is_some() && step.wait_until > step.wait_since);
    assert_eq!(view.doubts.len(), 1, "the remote may have acted");
    let query = Action::QueryRemote { seq: step.seq };
    assert_eq!(view.doubts[0].safe_action.as_ref(), Some(&query));
    assert_eq!(view.allowed.first(), Some(&query), "the safe action first");
    let done = processes::admin::act(
        &db.pool,
        &schema(),
        asked,
        &operator(query, view.process.row_version, None, None),
    )
    .await
    .unwrap();
    assert!(done.audit_ref > 0);
    wait_status(&db.pool, asked, "succeeded").await;
    let (_, _, reference, reason) = wait_step(&db.pool, asked).await;
    assert_eq!(reference.as_deref(), Some("charge:asked"));
    assert!(reason.contains("status query found"), "{reason}");
    assert_eq!(confirmations(&db.pool, asked).await, 1);

    let view = processes::admin::get(&db.pool, &schema(), blind)
        .await
        .unwrap();
    let seq = view
        .steps
        .iter()
        .find(|s| s.is_waiting())
        .expect("the parked wait")
        .seq;
    let version = view.process.row_version;
    assert!(!view.allowed.contains(&Action::QueryRemote { seq }));
    assert!(view.doubts[0].safe_action.is_none());
    let refused = [
        operator(Action::QueryRemote { seq }, version, None, None),
        operator(Action::ResolveFailed { seq }, version, None, Some("bob")),
    ];
    for req in refused {
        let e = processes::admin::act(&db.pool, &schema(), blind, &req)
            .await
            .expect_err("refused");
        eprintln!("refused as expected: {e}");
    }
    let check = RemoteCheck {
        checked: "provider dashboard, charges by reference blind".into(),
        answer: "no charge".into(),
    };
    let lone = operator(
        Action::ResolveFailed { seq },
        version,
        Some(check.clone()),
        None,
    );
    assert!(
        processes::admin::act(&db.pool, &schema(), blind, &lone)
            .await
            .is_err(),
        "one person"
    );
    assert_eq!(status(&db.pool, blind).await, "waiting", "nothing changed");
    processes::admin::act(
        &db.pool,
        &schema(),
        blind,
        &operator(
            Action::ResolveFailed { seq },
            version,
            Some(check),
            Some("bob"),
        ),
    )
    .await
    .unwrap();
    let p = db.pool.clone();
    wait_until("the resolved process ends", WAIT, || {
        let p = p.clone();
        async move {
            let s = status(&p, blind).await;
            matches!(s.as_str(), "failed" | "compensated").then_some(s)
        }
    })
    .await;
    assert_eq!(wait_step(&db.pool, blind).await.0, "failed");
    // The event that comes after wakes nothing and confirms nothing.
    let late = signal(&db.pool, "blind", "succeeded").await;
    assert!(late.woken.is_empty());
    assert_eq!(confirmations(&db.pool, blind).await, 0);
    w.stop().await;
    db.pool.close().await;
}

#[tokio::test]
async fn a_worker_killed_while_a_process_waits_leaves_nothing_held_and_another_finishes_it() {
    let db = setup().await;
    let id = start(&db.pool, "await_query", "k1").await;
    let mut a = ChildWorker::spawn(&db, "a", &[]);
    wait_parked(&db.pool, id).await;
    a.sigkill();
    let s = signal(&db.pool, "k1", "succeeded").await;
    assert_eq!(s.woken, vec![id]);
    let _b = ChildWorker::spawn(&db, "b", &[]);
    wait_status(&db.pool, id, "succeeded").await;
    assert_eq!(confirmations(&db.pool, id).await, 1);
    let reasons: Vec<String> = sqlx::query_scalar(
        "SELECT reason FROM outbox.process_history WHERE process_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        !reasons.iter().any(|r| r.contains("expired")),
        "a waiting process has no lease to expire: {reasons:?}"
    );
    db.pool.close().await;
}

#[tokio::test]
async fn a_worker_killed_at_the_moment_of_wake_up_is_taken_over_and_the_event_applied_once() {
    let db = setup().await;
    let id = start(&db.pool, "await_query", "k2").await;
    let mut a = ChildWorker::spawn(&db, "a", &[("PROCESS_FAILPOINT", "die_on:received")]);
    wait_parked(&db.pool, id).await;
    signal(&db.pool, "k2", "succeeded").await;
    let died = a.exited().await;
    assert!(!died.success(), "the failpoint aborts the worker: {died:?}");
    assert_eq!(
        status(&db.pool, id).await,
        "running",
        "claimed by the dead worker"
    );
    assert_eq!(wait_step(&db.pool, id).await.0, "running");
    let _b = ChildWorker::spawn(&db, "b", &[]);
    wait_status(&db.pool, id, "succeeded").await;
    assert_eq!(confirmations(&db.pool, id).await, 1);
    let (_, attempts, reference, _) = wait_step(&db.pool, id).await;
    assert_eq!((attempts, reference.as_deref()), (1, Some("charge:k2")));
    db.pool.close().await;
}

#[tokio::test]
async fn a_timer_survives_a_worker_restart() {
    let db = setup().await;
    let mut tx = db.pool.begin().await.unwrap();
    let id = processes::start(&mut *tx, &wf::timer(), "t1", &json!({"delay_ms": 4000}))
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    let mut a = ChildWorker::spawn(&db, "a", &[]);
    wait_parked(&db.pool, id).await;
    let at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT wait_until FROM outbox.process_steps WHERE process_id = $1 AND name = 'timer'",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    a.sigkill();
    let _b = ChildWorker::spawn(&db, "b", &[]);
    wait_status(&db.pool, id, "succeeded").await;
    let finished: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT finished_at FROM outbox.processes WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        finished >= at,
        "continued at {finished}, before its time {at}"
    );
    let still: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT wait_until FROM outbox.process_steps WHERE process_id = $1 AND name = 'timer'",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        still, at,
        "the restart kept the stored time, it did not start the timer again"
    );
    assert_eq!(confirmations(&db.pool, id).await, 1);
    db.pool.close().await;
}

/// CPU time (user + system) of this test process so far, from /proc/self/stat (clock ticks of
/// 1/100 s, Linux's USER_HZ).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The fields after the command name (which is in parentheses and may contain spaces).
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: u64 = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    Duration::from_millis(ticks * 10)
}

/// Parks `WAITING_PROCESSES` (default 100,000) processes at their wait, in the state a worker
/// leaves them (step running with its key and deadline, process waiting without a lease), then
/// measures rows and table sizes, one claim's cost, and a worker's CPU over 10 idle seconds; one
/// of them, woken, still finishes promptly.
#[tokio::test]
async fn the_cost_of_100k_waiting_processes_is_rows() {
    let db = setup().await;
    let n: i64 = std::env::var("WAITING_PROCESSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    // One real process parked by a worker, as the template of the others' rows.
    let first = start(&db.pool, "await_query", "c-0").await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_parked(&db.pool, first).await;
    w.stop().await;
    let made = Instant::now();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET statement_timeout = 0;
         INSERT INTO outbox.processes (id, kind, definition_version, business_key, revision, status, last_reason,
             last_actor, input, input_redacted, next_run_at, attempt, lease_token)
         SELECT gen_random_uuid(), p.kind, p.definition_version, 'c-' || g, p.revision, 'pending', p.last_reason, p.last_actor,
             jsonb_build_object('charge_id', 'c-' || g), jsonb_build_object('charge_id', 'c-' || g),
             p.next_run_at, p.attempt, p.lease_token
         FROM outbox.processes p, generate_series(1, {m}) g WHERE p.id = '{first}';
         INSERT INTO outbox.process_steps (process_id, seq, name, role, execution, remote, status, operation_id,
             attempts, max_attempts, first_attempt_at, last_attempt_at, remote_ref, result_ref, output,
             last_reason, last_actor, lease_token, finished_at, wait_key, wait_since, wait_until)
         SELECT n.id, s.seq, s.name, s.role, s.execution, s.remote, s.status,
             md5(n.id::text || '/forward/' || s.name)::uuid, s.attempts, s.max_attempts, s.first_attempt_at,
             s.last_attempt_at, s.remote_ref, CASE WHEN s.result_ref IS NULL THEN NULL ELSE n.business_key END,
             CASE WHEN s.output IS NULL THEN NULL ELSE jsonb_build_object('charge_id', n.business_key) END,
             s.last_reason, s.last_actor, s.lease_token, s.finished_at,
             CASE WHEN s.wait_key IS NULL THEN NULL ELSE 'charge:' || n.business_key END, s.wait_since,
             CASE WHEN s.wait_until IS NULL THEN NULL ELSE now() + interval '1 hour' END
         FROM outbox.processes n, outbox.process_steps s
         WHERE n.id <> '{first}' AND s.process_id = '{first}';
         UPDATE outbox.processes n SET status = 'running' WHERE n.id <> '{first}';
         UPDATE outbox.processes n SET status = 'waiting', next_run_at = now() + interval '1 hour'
         WHERE n.id <> '{first}';
         UPDATE outbox.processes SET next_run_at = now() + interval '1 hour' WHERE id = '{first}';
         UPDATE outbox.process_steps SET wait_until = now() + interval '1 hour'
         WHERE process_id = '{first}' AND wait_until IS NOT NULL;",
        m = n - 1
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    eprintln!("made {n} waiting processes in {:?}", made.elapsed());
    for table in ["processes", "process_steps", "process_history"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "VACUUM ANALYZE outbox.{table}"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let r = sqlx::query(
        "SELECT (SELECT count(*) FROM outbox.processes WHERE status = 'waiting' AND lease_owner IS NULL) AS waiting,
                (SELECT count(*) FROM outbox.process_steps) AS steps,
                (SELECT count(*) FROM outbox.process_history) AS history,
                pg_total_relation_size('outbox.processes') AS processes_bytes,
                pg_total_relation_size('outbox.process_steps') AS steps_bytes,
                pg_total_relation_size('outbox.process_history') AS history_bytes,
                pg_relation_size('outbox.processes_due_idx') AS due_idx_bytes,
                pg_relation_size('outbox.process_steps_wait_key_idx') AS wait_key_idx_bytes",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let waiting: i64 = r.get("waiting");
    assert_eq!(waiting, n);
    let mb = |c: &str| r.get::<i64, _>(c) as f64 / 1_048_576.0;
    eprintln!(
        "rows: {waiting} processes waiting, {} steps, {} history rows; sizes (tables with indexes): processes {:.1} MiB, process_steps {:.1} MiB, process_history {:.1} MiB; due index {:.2} MiB, wait key index {:.2} MiB; per waiting process {:.0} bytes",
        r.get::<i64, _>("steps"),
        r.get::<i64, _>("history"),
        mb("processes_bytes"),
        mb("steps_bytes"),
        mb("history_bytes"),
        mb("due_idx_bytes"),
        mb("wait_key_idx_bytes"),
        (r.get::<i64, _>("processes_bytes")
            + r.get::<i64, _>("steps_bytes")
            + r.get::<i64, _>("history_bytes")) as f64
            / n as f64
    );
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN (ANALYZE, BUFFERS) SELECT id FROM outbox.processes p
         WHERE p.status IN ('pending', 'running', 'waiting', 'compensating') AND NOT p.paused
           AND p.next_run_at <= now() AND (p.lease_until IS NULL OR p.lease_until < now())
         ORDER BY p.next_run_at LIMIT 32",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!(
        "the claim's search with nothing due:\n  {}",
        plan.join("\n  ")
    );

    // A worker with the default settings over them, idle for 10 s: its CPU and the claims it makes.
    let config = WorkerConfig::new(db.pool.clone(), schema(), "idle");
    let w = InProcessWorker::start_with(config, registry(&db.pool));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (cpu, wall) = (cpu_time() - cpu0, wall0.elapsed());
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    eprintln!(
        "idle worker over {n} waiting processes: {cpu:?} CPU in {wall:?} ({:.2}% of a core, the test process as a whole)",
        share * 100.0
    );
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.processes WHERE status <> 'waiting'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(running, 0, "no waiting process was claimed");
    assert!(
        share < 0.05,
        "an idle worker costs {:.2}% of a core",
        share * 100.0
    );

    // One of them woken: it finishes without scanning the others.
    let woken_at = Instant::now();
    let s = signal(&db.pool, "c-77", "succeeded").await;
    assert_eq!(s.woken.len(), 1);
    let id = s.woken[0];
    wait_status(&db.pool, id, "succeeded").await;
    eprintln!(
        "signal to succeeded among {n} waiting: {:?}",
        woken_at.elapsed()
    );
    w.stop().await;
    db.pool.close().await;
}
