//! Process steps that wait, against the real PostgreSQL: an event kept for a process that has not
//! reached its wait, the wake-up committed (or rolled back) with the caller's transaction, the
//! deadline followed by a status query or manual review, workers killed while a process waits and
//! at the moment of its wake-up, a timer across a restart, and operators acting on a parked wait.
//! What 100,000 waiting processes cost is measured by the bench (`processes-waiting`).

use processes::Registry;
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
