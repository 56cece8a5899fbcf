//! Recoverable processes against the real PostgreSQL: interruptions by SIGKILL of real worker
//! processes (`process_worker`, failpoints from `PROCESS_FAILPOINT`), unknown outcomes resolved by
//! what the remote supports, compensation, manual review, versions and revisions. Every case
//! asserts the stored state and the number of effects the fake remote recorded.

use processes::admin::{self, Action as AdminAction, Request};
use processes::{Registry, Remote};
use serde_json::json;
use shared::schema::Schema;
use sqlx::{PgPool, Row};
use std::time::Duration;
use system_tests::process_fixtures::{self as fx, Failpoint};
use system_tests::workers::{ChildWorker, InProcessWorker, status, wait_status};
use system_tests::{TestDb, init_logging, wait_until};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

async fn setup() -> TestDb {
    init_logging();
    let db = TestDb::new().await;
    fx::setup(&db.pool).await.expect("fake remote");
    db
}

/// Closes the pool while this test's runtime still runs (connections released by spawned tasks
/// come back), so dropping the database does not wait for them.
async fn close(db: TestDb) {
    db.pool.close().await;
}

fn schema() -> Schema {
    Schema::default()
}

fn input(charge: &str) -> serde_json::Value {
    json!({"amount": 5, "card": "4111111111111111", "charge": charge})
}

fn def(pool: &PgPool, kind: &str) -> processes::Definition {
    let remote = fx::ORDER_KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|(_, r)| *r)
        .unwrap_or(Remote::HonoursKey);
    fx::order(kind, remote, 1, pool, &Failpoint::default())
}

async fn start(pool: &PgPool, kind: &str, key: &str, input: &serde_json::Value) -> Uuid {
    let mut tx = pool.begin().await.unwrap();
    let s = processes::start(&mut *tx, &def(pool, kind), key, input)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    s.id
}

/// A worker in this test process.
fn registry(pool: &PgPool) -> Registry {
    fx::registry(pool, &Failpoint::default())
}

async fn wait_failpoint(pool: &PgPool, name: &str) {
    let p = pool.clone();
    let n = name.to_string();
    wait_until(&format!("failpoint {name}"), WAIT, || {
        let p = p.clone();
        let n = n.clone();
        async move {
            let r: Option<String> =
                sqlx::query_scalar("SELECT name FROM fake_remote.failpoints WHERE name = $1")
                    .bind(&n)
                    .fetch_optional(&p)
                    .await
                    .unwrap();
            r.map(|_| ())
        }
    })
    .await;
}

/// (name, role, status, attempts, error_class, remote_ref, result_ref) of a step.
type StepRow = (
    String,
    String,
    String,
    i32,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// Waits until the lease of process `id` has run out (its holder stopped renewing it).
async fn wait_lease_expired(pool: &PgPool, id: Uuid) {
    wait_until("lease expired", WAIT, || async move {
        let expired: bool =
            sqlx::query_scalar("SELECT lease_until < now() FROM outbox.processes WHERE id = $1")
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap();
        expired.then_some(())
    })
    .await;
}

/// An operator's action on process `id` (the default schema).
async fn act(
    pool: &PgPool,
    id: Uuid,
    request: &Request,
) -> Result<admin::Outcome, processes::Error> {
    admin::act(pool, &schema(), id, request).await
}

/// Alice resolves the charge at `seq` as succeeded, with the provider's charge `ch_<remote_ref>`
/// as evidence, having seen `seen_version`, approved by `approved_by`.
fn found_in_dashboard(
    seq: i32,
    remote_ref: i64,
    seen_version: i64,
    approved_by: Option<&str>,
) -> Request {
    Request {
        action: AdminAction::ResolveSucceeded { seq },
        reason: "charge found in the provider dashboard".into(),
        seen_version,
        actor: "alice".into(),
        evidence: Some(format!("ch_{remote_ref}")),
        remote_check: None,
        approved_by: approved_by.map(String::from),
    }
}

async fn steps(pool: &PgPool, id: Uuid) -> Vec<StepRow> {
    sqlx::query("SELECT name, role, status, attempts, error_class, remote_ref, result_ref FROM outbox.process_steps WHERE process_id = $1 ORDER BY seq")
        .bind(id)
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                r.get("name"),
                r.get("role"),
                r.get("status"),
                r.get("attempts"),
                r.get("error_class"),
                r.get("remote_ref"),
                r.get("result_ref"),
            )
        })
        .collect()
}

fn step<'a>(s: &'a [StepRow], name: &str, role: &str) -> &'a StepRow {
    s.iter()
        .find(|x| x.0 == name && x.1 == role)
        .unwrap_or_else(|| panic!("no {role} step {name} in {s:?}"))
}

async fn history_reasons(pool: &PgPool, id: Uuid) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT reason FROM outbox.process_history WHERE process_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_process_runs_its_steps_once_and_a_second_start_returns_it() {
    let db = setup().await;
    let d = def(&db.pool, "order_key");
    let mut tx = db.pool.begin().await.unwrap();
    let first = processes::start(&mut *tx, &d, "order-1", &input("ok"))
        .await
        .unwrap();
    let again = processes::start(&mut *tx, &d, "order-1", &input("ok"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(first.created && !again.created);
    assert_eq!(first.id, again.id);
    // A start rolled back with its caller's transaction leaves nothing.
    let mut tx = db.pool.begin().await.unwrap();
    let gone = processes::start(&mut *tx, &d, "order-2", &input("ok"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let w = InProcessWorker::start(&db.pool, "w1", registry(&db.pool));
    wait_status(&db.pool, first.id, "succeeded").await;
    w.stop().await;

    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.processes WHERE id = $1")
        .bind(gone.id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    let s = steps(&db.pool, first.id).await;
    assert_eq!(s.len(), 3);
    assert!(s.iter().all(|x| x.2 == "succeeded" && x.3 == 1), "{s:?}");
    assert!(
        step(&s, "charge", "forward")
            .5
            .as_deref()
            .unwrap_or("")
            .starts_with("ch_")
    );
    assert_eq!(fx::effects(&db.pool, first.id).await, (1, 0));
    // Stored for display: the card is redacted; the console view never shows it.
    let view = admin::get(&db.pool, &schema(), first.id).await.unwrap();
    assert_eq!(view.input["card"], "[redacted]");
    assert!(
        !serde_json::to_string(&view)
            .unwrap()
            .contains("4111111111111111")
    );
    assert!(
        view.allowed.is_empty(),
        "a finished process offers no action: {:?}",
        view.allowed
    );
    assert!(
        view.history
            .iter()
            .any(|h| h.step_seq.is_none() && h.to_status == "succeeded")
    );
    let listed = admin::list(&db.pool, &schema(), &admin::Filter::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    close(db).await;
}

#[tokio::test]
async fn the_database_refuses_illegal_transitions_missing_evidence_and_history_edits() {
    let db = setup().await;
    let id = start(&db.pool, "order_key", "k", &input("ok")).await;
    let e = sqlx::query("UPDATE outbox.processes SET status = 'succeeded', finished_at = now(), last_reason = 'x' WHERE id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("may not go from pending to succeeded"),
        "{e}"
    );
    let e = sqlx::query("UPDATE outbox.process_steps SET status = 'succeeded', finished_at = now() WHERE process_id = $1 AND seq = 0")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("process_steps_succeeded_has_evidence"),
        "{e}"
    );
    sqlx::query(
        "UPDATE outbox.processes SET status = 'running', last_reason = 'test' WHERE id = $1",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();
    let e = sqlx::query("UPDATE outbox.processes SET status = 'succeeded', finished_at = now(), last_reason = 'x' WHERE id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("processes_succeeded_has_evidence")
            || e.to_string().contains("cannot succeed"),
        "{e}"
    );
    let e = sqlx::query("DELETE FROM outbox.process_history WHERE process_id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("append-only"), "{e}");
    let e = sqlx::query("UPDATE outbox.process_history SET reason = 'rewritten'")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("append-only"), "{e}");
    close(db).await;
}

#[tokio::test]
async fn a_worker_killed_before_a_step_is_resumed_by_another() {
    let db = setup().await;
    let id = start(&db.pool, "order_key", "k", &input("ok")).await;
    let mut a = ChildWorker::spawn(&db, "a", &[("PROCESS_FAILPOINT", "hang_before:confirm")]);
    wait_failpoint(&db.pool, "hang_before:confirm").await;
    a.sigkill();
    let _b = ChildWorker::spawn(&db, "b", &[]);
    wait_status(&db.pool, id, "succeeded").await;
    assert_eq!(fx::effects(&db.pool, id).await, (1, 0));
    let confirmations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fake_shop.confirmations WHERE process_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(confirmations, 1);
    let s = steps(&db.pool, id).await;
    assert_eq!(
        step(&s, "confirm", "forward").3,
        1,
        "the killed attempt rolled back and was not counted: {s:?}"
    );
    assert!(
        history_reasons(&db.pool, id)
            .await
            .iter()
            .any(|r| r.contains("lease of a expired; taken over by b"))
    );
}

/// Kill after the remote acted but before the result was stored: what happens depends on what the remote supports.
async fn killed_after_the_remote_acted(kind: &str) -> (TestDb, Uuid, ChildWorker) {
    let db = setup().await;
    let id = start(&db.pool, kind, "k", &input("ok")).await;
    let mut a = ChildWorker::spawn(
        &db,
        "a",
        &[("PROCESS_FAILPOINT", "hang_after_effect:charge")],
    );
    wait_failpoint(&db.pool, "hang_after_effect:charge").await;
    a.sigkill();
    assert_eq!(
        step(&steps(&db.pool, id).await, "charge", "forward").2,
        "running",
        "the attempt was committed before the call"
    );
    let b = ChildWorker::spawn(&db, "b", &[]);
    (db, id, b)
}

#[tokio::test]
async fn killed_after_the_remote_acted_with_keys_retries_with_the_same_key() {
    let (db, id, _b) = killed_after_the_remote_acted("order_key").await;
    wait_status(&db.pool, id, "succeeded").await;
    assert_eq!(fx::effects(&db.pool, id).await, (1, 0), "one charge");
    assert_eq!(step(&steps(&db.pool, id).await, "charge", "forward").3, 2);
    close(db).await;
}

#[tokio::test]
async fn killed_after_the_remote_acted_without_keys_queries_first() {
    let (db, id, _b) = killed_after_the_remote_acted("order_query").await;
    wait_status(&db.pool, id, "succeeded").await;
    assert_eq!(fx::effects(&db.pool, id).await, (1, 0), "one charge");
    let s = steps(&db.pool, id).await;
    assert_eq!(step(&s, "charge", "forward").3, 1, "no second call");
    assert!(
        history_reasons(&db.pool, id)
            .await
            .iter()
            .any(|r| r.contains("found at the remote by operation id"))
    );
    close(db).await;
}

#[tokio::test]
async fn killed_after_the_remote_acted_with_neither_goes_to_manual_review_and_an_operator_resolves_it()
 {
    let (db, id, _b) = killed_after_the_remote_acted("order_none").await;
    wait_status(&db.pool, id, "manual_review").await;
    assert_eq!(
        fx::effects(&db.pool, id).await,
        (1, 0),
        "not retried blindly"
    );
    let view = admin::get(&db.pool, &schema(), id).await.unwrap();
    let charge = view.steps.iter().find(|s| s.name == "charge").unwrap();
    assert_eq!(
        (charge.status.as_str(), charge.error_class.as_deref()),
        ("manual_review", Some("unknown"))
    );
    assert!(
        view.allowed
            .contains(&AdminAction::ResolveSucceeded { seq: charge.seq })
    );
    assert!(
        !view
            .allowed
            .contains(&AdminAction::RerunStep { seq: charge.seq }),
        "a call of unknown outcome without key is not rerun: {:?}",
        view.allowed
    );
    // The operator looked at the remote and found the charge.
    let remote_ref: i64 =
        sqlx::query_scalar("SELECT id FROM fake_remote.charges WHERE process_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let stale = act(
        &db.pool,
        id,
        &found_in_dashboard(
            charge.seq,
            remote_ref,
            view.process.row_version - 1,
            Some("bob"),
        ),
    )
    .await
    .unwrap_err();
    assert!(matches!(stale, processes::Error::Stale { .. }), "{stale}");
    let missing = act(
        &db.pool,
        id,
        &Request {
            action: AdminAction::ResolveSucceeded { seq: charge.seq },
            reason: "no evidence".into(),
            seen_version: view.process.row_version,
            actor: "alice".into(),
            evidence: None,
            remote_check: None,
            approved_by: Some("bob".into()),
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(missing, processes::Error::Invalid(_)), "{missing}");
    // The outcome is unknown and the remote can neither deduplicate nor be queried: the view says
    // so and has no safe action to offer; deciding either way takes a second person, and
    // resolving as failed what was checked at the remote and its answer.
    assert_eq!(view.doubts.len(), 1, "{:?}", view.doubts);
    assert_eq!(
        (view.doubts[0].seq, view.doubts[0].safe_action.as_ref()),
        (charge.seq, None)
    );
    assert!(view.doubts[0].warning.contains("may have acted"));
    let failed = AdminAction::ResolveFailed { seq: charge.seq };
    assert!(view.allowed.contains(&failed));
    assert_eq!(
        admin::requirements(&failed, &view.steps),
        admin::Requirements {
            evidence: false,
            remote_check: true,
            second_person: true
        }
    );
    let check = admin::RemoteCheck {
        checked: "provider dashboard by operation id".into(),
        answer: "no charge".into(),
    };
    for (remote_check, approved_by, refused) in [
        (None, Some("bob"), "remote check"),
        (Some(check.clone()), None, "second person"),
        (Some(check.clone()), Some("alice"), "second person"),
        (
            Some(admin::RemoteCheck {
                checked: " ".into(),
                answer: "no charge".into(),
            }),
            Some("bob"),
            "'checked'",
        ),
    ] {
        let e = act(
            &db.pool,
            id,
            &Request {
                action: failed.clone(),
                reason: "one person's guess".into(),
                seen_version: view.process.row_version,
                actor: "alice".into(),
                evidence: None,
                remote_check,
                approved_by: approved_by.map(String::from),
            },
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains(refused), "{refused}: {e}");
    }
    let alone = act(
        &db.pool,
        id,
        &found_in_dashboard(charge.seq, remote_ref, view.process.row_version, None),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(alone, processes::Error::NeedsSecondPerson { .. }),
        "{alone}"
    );
    assert_eq!(
        admin::get(&db.pool, &schema(), id)
            .await
            .unwrap()
            .process
            .row_version,
        view.process.row_version,
        "nothing refused changed anything"
    );
    let done = act(
        &db.pool,
        id,
        &found_in_dashboard(
            charge.seq,
            remote_ref,
            view.process.row_version,
            Some("bob"),
        ),
    )
    .await
    .unwrap();
    assert!(done.audit_ref > 0);
    wait_status(&db.pool, id, "succeeded").await;
    assert_eq!(fx::effects(&db.pool, id).await, (1, 0));
    let view = admin::get(&db.pool, &schema(), id).await.unwrap();
    assert!(view.steps.iter().any(|s| s.role == "resolution"
        && s.acts_on == Some(charge.seq)
        && s.last_actor == "alice (approved by bob)"));
    assert!(
        view.history.iter().any(
            |h| h.actor == "alice (approved by bob)" && h.reason.contains("provider dashboard")
        )
    );
    close(db).await;
}

#[tokio::test]
async fn a_worker_killed_during_compensation_is_resumed_and_each_effect_is_undone_once() {
    let db = setup().await;
    let mut i = input("ok");
    i["reject_confirm"] = json!(true);
    let id = start(&db.pool, "order_key", "k", &i).await;
    let mut a = ChildWorker::spawn(
        &db,
        "a",
        &[("PROCESS_FAILPOINT", "hang_after_compensation_effect:charge")],
    );
    wait_failpoint(&db.pool, "hang_after_compensation_effect:charge").await;
    a.sigkill();
    let _b = ChildWorker::spawn(&db, "b", &[]);
    wait_status(&db.pool, id, "compensated").await;
    assert_eq!(
        fx::effects(&db.pool, id).await,
        (1, 1),
        "one charge, one refund"
    );
    let released: bool =
        sqlx::query_scalar("SELECT released FROM fake_shop.reservations WHERE process_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(released);
    let s = steps(&db.pool, id).await;
    // Done, then compensated: the forward steps keep their evidence; compensations are linked rows.
    assert_eq!(step(&s, "reserve", "forward").2, "succeeded");
    assert_eq!(step(&s, "charge", "forward").2, "succeeded");
    assert_eq!(step(&s, "confirm", "forward").2, "failed");
    assert_eq!(
        step(&s, "confirm", "forward").4.as_deref(),
        Some("permanent")
    );
    assert_eq!(step(&s, "charge", "compensation").2, "succeeded");
    assert_eq!(step(&s, "reserve", "compensation").2, "succeeded");
    let order: Vec<String> = sqlx::query_scalar("SELECT name FROM outbox.process_steps WHERE process_id = $1 AND role = 'compensation' ORDER BY seq")
        .bind(id)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(order, ["charge", "reserve"], "reverse order");
    close(db).await;
}

#[tokio::test]
async fn two_workers_started_at_once_run_every_process_once() {
    let db = setup().await;
    let mut ids = Vec::new();
    for n in 0..20 {
        ids.push(start(&db.pool, "order_query", &format!("k{n}"), &input("ok")).await);
    }
    let _a = ChildWorker::spawn(&db, "a", &[]);
    let _b = ChildWorker::spawn(&db, "b", &[]);
    for id in &ids {
        wait_status(&db.pool, *id, "succeeded").await;
        assert_eq!(fx::effects(&db.pool, *id).await, (1, 0));
    }
    let doubles: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT process_id, step_seq FROM outbox.process_history \
         WHERE to_status = 'succeeded' GROUP BY 1, 2 HAVING count(*) > 1) d",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(doubles, 0, "no step or process succeeded twice");
    close(db).await;
}

#[tokio::test]
async fn a_worker_whose_lease_expired_during_a_call_is_fenced_off() {
    let db = setup().await;
    let id = start(&db.pool, "order_key", "k", &input("ok")).await;
    let a = ChildWorker::spawn(
        &db,
        "a",
        &[
            ("PROCESS_FAILPOINT", "stall_after_effect:charge"),
            ("LEASE_MS", "1000"),
        ],
    );
    wait_failpoint(&db.pool, "stall_after_effect:charge").await;
    let a_token: i64 = sqlx::query_scalar("SELECT lease_token FROM outbox.processes WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    a.signal("STOP"); // paused: no heartbeats
    wait_lease_expired(&db.pool, id).await;
    let _b = ChildWorker::spawn(&db, "b", &[]);
    wait_status(&db.pool, id, "succeeded").await;
    sqlx::query("INSERT INTO fake_remote.flags (name) VALUES ('release')")
        .execute(&db.pool)
        .await
        .unwrap();
    a.signal("CONT");
    wait_until("worker a reports the fenced write", WAIT, || async {
        a.said("fenced").then_some(())
    })
    .await;
    assert_eq!(status(&db.pool, id).await, "succeeded");
    assert_eq!(fx::effects(&db.pool, id).await, (1, 0));
    let tokens: Vec<i64> = sqlx::query_scalar(
        "SELECT h.lease_token FROM outbox.process_history h JOIN outbox.process_steps s ON s.process_id = h.process_id AND s.seq = h.step_seq \
         WHERE h.process_id = $1 AND s.name = 'charge' AND h.to_status = 'succeeded'",
    )
    .bind(id)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(tokens.len(), 1, "one completion");
    assert!(
        tokens[0] > a_token,
        "completed by the later owner ({} > {a_token})",
        tokens[0]
    );
    close(db).await;
}

#[tokio::test]
async fn a_timeout_is_an_unknown_outcome_resolved_by_what_the_remote_supports() {
    let db = setup().await;
    let key = start(&db.pool, "order_key", "k1", &input("timeout_once")).await;
    let query = start(&db.pool, "order_query", "k2", &input("timeout_once")).await;
    let none = start(&db.pool, "order_none", "k3", &input("timeout_once")).await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_status(&db.pool, key, "succeeded").await;
    wait_status(&db.pool, query, "succeeded").await;
    wait_status(&db.pool, none, "manual_review").await;
    w.stop().await;
    assert_eq!(fx::effects(&db.pool, key).await, (1, 0));
    assert_eq!(
        step(&steps(&db.pool, key).await, "charge", "forward").3,
        2,
        "retried with the same key"
    );
    assert_eq!(fx::effects(&db.pool, query).await, (1, 0));
    assert_eq!(
        step(&steps(&db.pool, query).await, "charge", "forward").3,
        1,
        "found by the query, not called again"
    );
    assert_eq!(fx::effects(&db.pool, none).await, (1, 0));
    let s = steps(&db.pool, none).await;
    let c = step(&s, "charge", "forward");
    assert_eq!(
        (c.2.as_str(), c.4.as_deref()),
        ("manual_review", Some("unknown")),
        "never failed"
    );
    close(db).await;
}

/// The first attempt acts at the remote but its answer comes too late (unknown); every retry with
/// the same key gets a 503 before the remote looks at the key. Those answers say nothing about the
/// first attempt, so when the attempts run out the outcome is still unknown: manual review with
/// the charge as the evidence, never "failed" and compensated as if nothing had been taken.
#[tokio::test]
async fn transient_errors_after_an_unknown_outcome_keep_it_unknown_until_review() {
    let db = setup().await;
    let id = start(&db.pool, "order_key", "k", &input("timeout_then_transient")).await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_until(&format!("process {id} settled"), WAIT, || async {
        let s = status(&db.pool, id).await;
        matches!(
            s.as_str(),
            "succeeded" | "failed" | "compensated" | "manual_review"
        )
        .then_some(())
    })
    .await;
    w.stop().await;
    let s = steps(&db.pool, id).await;
    assert_eq!(status(&db.pool, id).await, "manual_review", "{s:?}");
    let c = step(&s, "charge", "forward");
    assert_eq!(
        (c.2.as_str(), c.3, c.4.as_deref()),
        ("manual_review", 4, Some("unknown")),
        "{s:?}"
    );
    assert!(
        s.iter().all(|x| x.1 != "compensation"),
        "the reservation is kept while the charge may exist: {s:?}"
    );
    assert_eq!(fx::effects(&db.pool, id).await, (1, 0), "charged once");
    close(db).await;
}

#[tokio::test]
async fn invalid_input_fails_permanently_without_retry() {
    let db = setup().await;
    let mut i = input("ok");
    i["amount"] = json!(0);
    let id = start(&db.pool, "order_key", "k", &i).await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_status(&db.pool, id, "failed").await;
    w.stop().await;
    let s = steps(&db.pool, id).await;
    let r = step(&s, "reserve", "forward");
    assert_eq!(
        (r.2.as_str(), r.3, r.4.as_deref()),
        ("failed", 1, Some("permanent"))
    );
    assert_eq!(step(&s, "charge", "forward").2, "pending", "never done");
    assert_eq!(fx::effects(&db.pool, id).await, (0, 0));
    close(db).await;
}

#[tokio::test]
async fn retry_limits_then_compensation_and_the_deadline() {
    let db = setup().await;
    let id = start(&db.pool, "order_key", "k", &input("transient_always")).await;
    let fp = Failpoint::default();
    let deadline_def =
        fx::order_with_deadline("order_deadline", Duration::from_millis(600), &db.pool, &fp);
    let mut tx = db.pool.begin().await.unwrap();
    let d = processes::start(&mut *tx, &deadline_def, "k", &input("transient_always"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let w = InProcessWorker::start(
        &db.pool,
        "w",
        registry(&db.pool)
            .with(fx::order_with_deadline(
                "order_deadline",
                Duration::from_millis(600),
                &db.pool,
                &fp,
            ))
            .unwrap(),
    );
    wait_status(&db.pool, id, "compensated").await;
    wait_status(&db.pool, d.id, "compensated").await;
    w.stop().await;
    let s = steps(&db.pool, id).await;
    let c = step(&s, "charge", "forward");
    assert_eq!(
        (c.2.as_str(), c.3, c.4.as_deref()),
        ("failed", 4, Some("transient")),
        "{s:?}"
    );
    assert_eq!(step(&s, "reserve", "compensation").2, "succeeded");
    assert!(
        s.iter()
            .all(|x| !(x.0 == "charge" && x.1 == "compensation")),
        "a charge never made is not refunded"
    );
    let s = steps(&db.pool, d.id).await;
    let c = step(&s, "charge", "forward");
    assert_eq!(c.2, "failed");
    assert!(c.3 < 1000, "stopped by the deadline after {} attempts", c.3);
    assert!(
        history_reasons(&db.pool, d.id)
            .await
            .iter()
            .any(|r| r.contains("deadline passed"))
    );
    close(db).await;
}

#[tokio::test]
async fn a_worker_without_the_definition_version_leaves_the_process_alone() {
    let db = setup().await;
    let fp = Failpoint::default();
    let v1 = fx::versioned(1, &db.pool, &fp);
    let v2 = fx::versioned(2, &db.pool, &fp);
    let mut tx = db.pool.begin().await.unwrap();
    let old = processes::start(&mut *tx, &v1, "old", &input("ok"))
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    // Mid-flight: a v1 worker dies before the last step.
    let mut a = ChildWorker::spawn(&db, "a", &[("PROCESS_FAILPOINT", "hang_before:confirm")]);
    wait_failpoint(&db.pool, "hang_before:confirm").await;
    a.sigkill();
    wait_lease_expired(&db.pool, old).await;
    // Only v2 deployed: it runs new processes and leaves the v1 one alone, saying so.
    let mut tx = db.pool.begin().await.unwrap();
    let new = processes::start(&mut *tx, &v2, "new", &input("ok"))
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    let mut b = ChildWorker::spawn(&db, "b", &[("PROCESS_VERSION", "2")]);
    wait_status(&db.pool, new, "succeeded").await;
    wait_until("worker b reports the unknown version", WAIT, || async {
        b.said("definition version this worker does not have")
            .then_some(())
    })
    .await;
    let r = sqlx::query(
        "SELECT status, attempt, definition_version FROM outbox.processes WHERE id = $1",
    )
    .bind(old)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (
            r.get::<String, _>("status"),
            r.get::<i32, _>("attempt"),
            r.get::<i32, _>("definition_version")
        ),
        ("running".into(), 1, 1)
    );
    assert_eq!(steps(&db.pool, new).await.len(), 4);
    assert!(b.sigterm_and_wait().success(), "SIGTERM exits 0");
    // A v1 worker comes back and finishes it with v1's steps.
    let _c = ChildWorker::spawn(&db, "c", &[("PROCESS_VERSION", "1")]);
    wait_status(&db.pool, old, "succeeded").await;
    assert_eq!(steps(&db.pool, old).await.len(), 3);
    assert_eq!(fx::effects(&db.pool, old).await, (1, 0));
    close(db).await;
}

#[tokio::test]
async fn a_revision_is_a_new_process_linked_to_the_old_one() {
    let db = setup().await;
    let mut bad = input("ok");
    bad["amount"] = json!(0);
    let old = start(&db.pool, "order_key", "order-9", &bad).await;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_status(&db.pool, old, "failed").await;
    let d = def(&db.pool, "order_key");
    let new = processes::revise(
        &db.pool,
        &schema(),
        &d,
        old,
        &input("ok"),
        "amount corrected",
        "alice",
    )
    .await
    .unwrap();
    wait_status(&db.pool, new, "succeeded").await;
    w.stop().await;
    assert_ne!(new, old);
    assert_eq!(
        status(&db.pool, old).await,
        "failed",
        "the old process is not edited"
    );
    let r = sqlx::query("SELECT revision, revision_of FROM outbox.processes WHERE id = $1")
        .bind(new)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        (
            r.get::<i32, _>("revision"),
            r.get::<Option<Uuid>, _>("revision_of")
        ),
        (1, Some(old))
    );
    let again = processes::start(&db.pool, &d, "order-9", &input("ok"))
        .await
        .unwrap();
    assert_eq!(
        (again.id, again.created),
        (new, false),
        "a replayed start finds the latest revision"
    );
    let old_input: serde_json::Value =
        sqlx::query_scalar("SELECT input FROM outbox.processes WHERE id = $1")
            .bind(old)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(old_input["amount"], 0);
    close(db).await;
}

#[tokio::test]
async fn a_sensitive_compensation_waits_for_approval() {
    let db = setup().await;
    let fp = Failpoint::default();
    let d = fx::order_sensitive_refund("order_sensitive", &db.pool, &fp);
    let mut i = input("ok");
    i["reject_confirm"] = json!(true);
    let id = processes::start(&db.pool, &d, "k", &i).await.unwrap().id;
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    wait_status(&db.pool, id, "manual_review").await;
    assert_eq!(
        fx::effects(&db.pool, id).await,
        (1, 0),
        "no refund without approval"
    );
    let view = admin::get(&db.pool, &schema(), id).await.unwrap();
    let refund = view
        .steps
        .iter()
        .find(|s| s.role == "compensation" && s.name == "charge")
        .unwrap();
    assert!(refund.sensitive && refund.status.as_str() == "manual_review");
    let action = AdminAction::RunCompensation { seq: refund.seq };
    assert!(view.allowed.contains(&action), "{:?}", view.allowed);
    assert!(action.sensitive());
    act(
        &db.pool,
        id,
        &Request {
            action,
            reason: "refund approved".into(),
            seen_version: view.process.row_version,
            actor: "bob".into(),
            evidence: None,
            remote_check: None,
            approved_by: Some("carol".into()),
        },
    )
    .await
    .unwrap();
    wait_status(&db.pool, id, "compensated").await;
    w.stop().await;
    assert_eq!(fx::effects(&db.pool, id).await, (1, 1));
    close(db).await;
}

#[tokio::test]
async fn operator_actions_pause_resume_escalate_and_cancel() {
    let db = setup().await;
    let id = start(&db.pool, "order_key", "k", &input("ok")).await;
    let v = admin::get(&db.pool, &schema(), id).await.unwrap();
    assert!(v.allowed.contains(&AdminAction::Pause) && v.allowed.contains(&AdminAction::Cancel));
    let req = |action, seen_version| Request {
        action,
        reason: "testing".into(),
        seen_version,
        actor: "carol".into(),
        evidence: None,
        remote_check: None,
        approved_by: None,
    };
    let o = act(
        &db.pool,
        id,
        &req(AdminAction::Pause, v.process.row_version),
    )
    .await
    .unwrap();
    let w = InProcessWorker::start(&db.pool, "w", registry(&db.pool));
    // A worker never claims a paused process; the only way to see that is to let another one finish first.
    let other = start(&db.pool, "order_key", "k2", &input("ok")).await;
    wait_status(&db.pool, other, "succeeded").await;
    assert_eq!(status(&db.pool, id).await, "pending");
    let e = act(
        &db.pool,
        id,
        &req(AdminAction::Resume, v.process.row_version),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, processes::Error::Stale { .. }));
    let o = act(&db.pool, id, &req(AdminAction::Escalate, o.row_version))
        .await
        .unwrap();
    assert_eq!(o.status.as_str(), "manual_review");
    let e = act(&db.pool, id, &req(AdminAction::Escalate, o.row_version))
        .await
        .unwrap_err();
    assert!(matches!(e, processes::Error::NotAllowed { .. }), "{e}");
    let o = act(&db.pool, id, &req(AdminAction::Cancel, o.row_version))
        .await
        .unwrap();
    assert_eq!(o.status.as_str(), "cancelled");
    w.stop().await;
    assert_eq!(fx::effects(&db.pool, id).await, (0, 0));
    let h = admin::get(&db.pool, &schema(), id).await.unwrap().history;
    assert!(h.iter().filter(|e| e.actor == "carol").count() >= 3);
    close(db).await;
}

/// The process row, its step rows and its history count, as they are: what a fenced write must
/// leave untouched.
async fn snapshot(pool: &PgPool, id: Uuid) -> (serde_json::Value, serde_json::Value, i64) {
    let process: serde_json::Value =
        sqlx::query_scalar("SELECT to_jsonb(p) FROM outbox.processes p WHERE id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    let steps: serde_json::Value = sqlx::query_scalar(
        "SELECT jsonb_agg(to_jsonb(s) ORDER BY seq) FROM outbox.process_steps s WHERE process_id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    let history: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.process_history WHERE process_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    (process, steps, history)
}

/// A lease handle whose process was taken over (a later claim drew a newer token) is fenced off:
/// every write it offers fails with `Fenced`, and the process, its steps and its history stay
/// exactly as the takeover left them; the new owner's handle still writes.
#[tokio::test]
async fn every_write_of_a_lease_taken_over_is_fenced_off_and_changes_nothing() {
    use processes::store::{self, Finish, LocalSuccess, NewCompensation, ProcessChange};
    use processes::store::{StepChange, WriteError};
    let db = setup().await;
    let pool = &db.pool;
    let id = start(pool, "order_key", "fenced", &input("ok")).await;
    let (kinds, versions) = (vec!["order_key".to_string()], vec![1]);
    let claim = |owner: &'static str, lease: Duration| {
        let (kinds, versions) = (kinds.clone(), versions.clone());
        async move {
            let mut conn = pool.acquire().await.unwrap();
            store::claim(
                &mut conn,
                &schema(),
                &kinds,
                &versions,
                1,
                owner,
                lease,
                None,
            )
            .await
            .unwrap()
            .0
        }
    };
    let old = claim("old", Duration::from_millis(1)).await;
    assert_eq!(old.len(), 1, "the old owner claims the process");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let new = claim("new", Duration::from_secs(60)).await;
    assert_eq!(new.len(), 1, "the new owner takes the expired lease over");
    let (old, new) = (&old[0].lease, &new[0].lease);
    assert_eq!(new.id(), id);
    assert!(new.token() > old.token(), "the takeover drew a newer token");
    let before = snapshot(pool, id).await;
    let fenced = |what: &str, r: Result<(), WriteError>| {
        assert!(matches!(r, Err(WriteError::Fenced(_))), "{what}: {r:?}");
    };
    fenced(
        "heartbeat",
        old.heartbeat(pool, Duration::from_secs(60)).await,
    );
    let mut tx = pool.begin().await.unwrap();
    fenced("fence", old.fence(&mut tx).await);
    tx.commit().await.unwrap();
    let output = json!({"x": 1});
    let changes = [
        StepChange::Begin { reason: "r" },
        StepChange::Succeeded {
            remote: true,
            reference: "ref",
            output: Some(&output),
            count_attempt: true,
            reason: "r",
        },
        StepChange::Retryable {
            class: "transient",
            message: "m",
            at: chrono::Utc::now(),
            count_attempt: true,
            reason: "r",
        },
        StepChange::Failed {
            class: "permanent",
            message: "m",
            count_attempt: true,
            reason: "r",
        },
        StepChange::Review {
            class: None,
            message: None,
            count_attempt: false,
            reason: "r",
        },
    ];
    for change in &changes {
        fenced(
            &format!("{change:?}"),
            old.change_step(pool, 1, change).await,
        );
    }
    let done = [LocalSuccess {
        seq: 1,
        reference: "ref",
        output: None,
    }];
    for finish in [None, Some((Finish::Succeeded, "r"))] {
        let mut tx = pool.begin().await.unwrap();
        let r = old.checkpoint_local(&mut tx, &done, finish).await;
        fenced(&format!("checkpoint_local {finish:?}"), r);
        tx.commit().await.unwrap();
    }
    for change in [
        ProcessChange::Release,
        ProcessChange::WaitUntil(chrono::Utc::now()),
        ProcessChange::Succeeded,
        ProcessChange::Failed,
        ProcessChange::Compensating,
        ProcessChange::Compensated,
        ProcessChange::ManualReview,
    ] {
        let mut tx = pool.begin().await.unwrap();
        let r = old.change_process(&mut tx, change, "r").await;
        fenced(&format!("change_process {change:?}"), r);
        tx.commit().await.unwrap();
    }
    let comp = [NewCompensation {
        acts_on: 1,
        name: "charge".into(),
        execution: "local",
        remote: None,
        sensitive: false,
        max_attempts: 1,
        label: None,
    }];
    let mut tx = pool.begin().await.unwrap();
    fenced(
        "add_compensations",
        old.add_compensations(&mut tx, &comp, "r").await,
    );
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let until = chrono::Utc::now() + chrono::TimeDelta::minutes(5);
    let r = old.begin_wait(&mut tx, 1, Some("key"), until, "r").await;
    fenced("begin_wait", r);
    tx.commit().await.unwrap();
    assert_eq!(
        snapshot(pool, id).await,
        before,
        "a fenced write changed nothing"
    );
    // The new owner's handle is not fenced: the writes above failed by the token alone.
    new.heartbeat(pool, Duration::from_secs(60)).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    new.fence(&mut tx).await.unwrap();
    tx.rollback().await.unwrap();
    close(db).await;
}
