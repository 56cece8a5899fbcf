//! The operations console over real HTTP, on a real database: the role × action matrix, four
//! eyes, stale versions, idempotency keys, CSRF, sessions, login limits, redaction, the
//! append-only audit table, the CLI, process actions on the processes crate, and a real headless
//! Chromium (a bulk requeue, and a refund of the demo's payment process requested by an operator
//! and approved by an approver while a worker runs it against the payment-provider simulator).

use console::ServeConfig;
use console::roles::{Action, Role, allowed};
use reqwest::StatusCode;
use serde_json::{Value, json};
use shared::schema::Schema;
use std::time::Duration;
use system_tests::browser::{chromedriver, click, follow, type_into, wait_for};
use system_tests::consoles::{self, RunningConsole};
use system_tests::process_fixtures as fx;
use system_tests::{TestDb, bin_path, wait_until};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

mod dependencies;
mod look;
mod money;

const CARD: &str = "4111111111111111";
const SECRET: &str = "hunter2-very-secret";

struct Console {
    db: TestDb,
    web: RunningConsole,
}

impl Console {
    async fn start() -> Self {
        Self::start_with(5, &[]).await
    }

    /// A console with `login_attempts` failed logins a minute per address, and `consumers` as
    /// its CONSOLE_CONSUMERS (the dead-letter queues it may browse and replay).
    async fn start_with(login_attempts: usize, consumers: &[&str]) -> Self {
        Self::start_configured(consumers, |c| {
            c.login_attempts_per_minute = login_attempts;
        })
        .await
    }

    /// A console on a fresh database with `consumers` as its CONSOLE_CONSUMERS and the test
    /// defaults ([`consoles::test_config`]), changed by `adjust`.
    async fn start_configured(consumers: &[&str], adjust: impl FnOnce(&mut ServeConfig)) -> Self {
        let db = TestDb::new().await;
        let mut config = consoles::test_config(&db.url, consumers);
        adjust(&mut config);
        let web = RunningConsole::start(config).await;
        Self { db, web }
    }

    async fn user(&self, name: &str, role: Role) -> String {
        console::users::create(&self.db.pool, &Schema::default(), name, role)
            .await
            .unwrap()
            .1
    }

    async fn get(&self, token: &str, path: &str) -> (StatusCode, String) {
        let r = self.web.api_get(token, path).await;
        (r.status(), r.text().await.unwrap())
    }

    /// Two approvers approve `path` (version 1) at the same moment, each `(token, reason, key)`:
    /// exactly one wins (200), the other gets 409. Returns the winner's index and answer.
    async fn approve_at_once(&self, path: &str, who: [(&str, &str, &str); 2]) -> (usize, Value) {
        let [a, b] = who.map(|(token, reason, key)| {
            self.post(
                token,
                path,
                json!({"reason": reason, "version": 1}),
                Some(key),
            )
        });
        let (ra, rb) = tokio::join!(a, b);
        let mut statuses = [ra.0, rb.0];
        statuses.sort();
        assert_eq!(
            statuses,
            [StatusCode::OK, StatusCode::CONFLICT],
            "{:?} {:?}",
            ra.1,
            rb.1
        );
        if ra.0 == StatusCode::OK {
            (0, ra.1)
        } else {
            (1, rb.1)
        }
    }

    async fn post(
        &self,
        token: &str,
        path: &str,
        body: Value,
        key: Option<&str>,
    ) -> (StatusCode, Value, bool) {
        let r = self.web.api_post(token, path, &body, key).await;
        let status = r.status();
        let replayed = r.headers().get("idempotent-replayed").is_some();
        let text = r.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
            replayed,
        )
    }

    /// [`Console::post`] that must answer `want` (the body is the assertion's message); returns
    /// the body.
    async fn post_expect(
        &self,
        token: &str,
        path: &str,
        body: Value,
        key: Option<&str>,
        want: StatusCode,
    ) -> Value {
        let (status, body, _) = self.post(token, path, body, key).await;
        assert_eq!(status, want, "{body}");
        body
    }

    /// `token` approves `approval` (version 1), which must answer 200; returns the answer.
    async fn approve(&self, token: &str, approval: &str) -> Value {
        let (status, body) = self.try_approve(token, approval, "ok").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body
    }

    /// `token` approves `approval` (version 1) giving `reason`, whatever the answer.
    async fn try_approve(&self, token: &str, approval: &str, reason: &str) -> (StatusCode, Value) {
        let (status, body, _) = self
            .post(
                token,
                &format!("/api/approvals/{approval}/approve"),
                json!({"reason": reason, "version": 1}),
                None,
            )
            .await;
        (status, body)
    }

    /// Inserts `n` dead rows carrying secrets; returns their ids.
    async fn dead_rows(&self, n: usize) -> Vec<Uuid> {
        sqlx::query_scalar(
            "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, state, attempts, last_error) \
             SELECT 'payment', 'p-' || g, 'payment.captured', \
                    jsonb_build_object('card_number', $1::text, 'customer_secret', $2::text, 'note', 'card ' || $1::text, 'amount', 12), \
                    'dead', 5, 'gateway said no for card ' || $1::text \
             FROM generate_series(1, $3) g RETURNING id",
        )
        .bind(CARD)
        .bind(SECRET)
        .bind(n as i32)
        .fetch_all(&self.db.pool)
        .await
        .unwrap()
    }

    /// Makes outbox row `id` dead again, as before its requeue.
    async fn make_dead(&self, id: Uuid) {
        sqlx::query("UPDATE outbox.messages SET state = 'dead' WHERE id = $1")
            .bind(id)
            .execute(&self.db.pool)
            .await
            .unwrap();
    }

    async fn version(&self, id: Uuid) -> i64 {
        sqlx::query_scalar("SELECT xmin::text::bigint FROM outbox.messages WHERE id = $1")
            .bind(id)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    async fn state(&self, id: Uuid) -> String {
        sqlx::query_scalar("SELECT state FROM outbox.messages WHERE id = $1")
            .bind(id)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    async fn audit_count(&self, actor: &str, action: &str, outcome: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox.console_audit WHERE actor_name = $1 AND action = $2 AND outcome = $3")
            .bind(actor)
            .bind(action)
            .bind(outcome)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Starts an order process of the test fixtures (its input carries a card number the
    /// definition declares secret). No worker runs it: it stays pending.
    async fn process(&self, key: &str) -> Uuid {
        let d = fx::order(
            "order_key",
            processes::Remote::HonoursKey,
            1,
            &self.db.pool,
            &fx::Failpoint::default(),
        );
        processes::start(
            &self.db.pool,
            &d,
            key,
            &json!({"amount": 5, "card": CARD, "charge": "ok"}),
        )
        .await
        .unwrap()
        .id
    }

    /// Runs the `console` CLI against this console as `token`.
    fn cli(&self, token: &str, args: &[&str]) -> std::process::Output {
        std::process::Command::new(bin_path("console"))
            .args(args)
            .env("CONSOLE_URL", &self.web.base)
            .env("CONSOLE_TOKEN", token)
            .output()
            .unwrap()
    }

    /// What `GET /api/processes/{id}` shows `token`.
    async fn process_view(&self, token: &str, id: Uuid) -> Value {
        let (s, body) = self.get(token, &format!("/api/processes/{id}")).await;
        assert_eq!(s, StatusCode::OK, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// The process row and its history, as stored: (status, paused, row_version, transitions).
    async fn process_state(&self, id: Uuid) -> (String, bool, i64, i64) {
        sqlx::query_as(
            "SELECT status, paused, row_version, \
                    (SELECT count(*) FROM outbox.process_history h WHERE h.process_id = p.id) \
             FROM outbox.processes p WHERE id = $1",
        )
        .bind(id)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    async fn approvals(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox.console_approvals")
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }
}

/// The names of the actions a process view offers now.
fn offered(view: &Value) -> Vec<String> {
    view["allowed_actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["action"].as_str().unwrap().to_string())
        .collect()
}

/// The request that exercises `action` (targets that do not exist: an allowed role gets past the
/// role check and then 404, never 403).
fn request_for(action: Action) -> (String, Value) {
    let nobody = Uuid::new_v4();
    match action {
        Action::Read => ("GET /api/outbox/dead".into(), Value::Null),
        Action::OutboxRequeue => (
            format!("/api/outbox/dead/{nobody}/actions/requeue"),
            json!({"reason": "matrix", "version": 1}),
        ),
        Action::DlqReplay => (
            "/api/dead-letters/no_such_consumer_for_matrix/actions/replay".into(),
            json!({"reason": "matrix", "items": [{"message_id": "m", "version": ""}]}),
        ),
        Action::ApprovalApprove => (
            format!("/api/approvals/{nobody}/approve"),
            json!({"reason": "matrix", "version": 1}),
        ),
        Action::ApprovalReject => (
            format!("/api/approvals/{nobody}/reject"),
            json!({"reason": "matrix", "version": 1}),
        ),
        Action::AuditPurge => (
            "/api/audit/actions/purge".into(),
            json!({"reason": "matrix"}),
        ),
        Action::DependencyCircuit(open) => (
            format!(
                "/api/dependencies/no_such_dependency_for_matrix/actions/{}",
                if open { "open" } else { "close" }
            ),
            json!({"reason": "matrix"}),
        ),
        Action::Process(p) => (
            format!("/api/processes/{nobody}/actions/{}", p.name()),
            json!({"reason": "matrix", "version": 1}),
        ),
        Action::Ordered(o) => (
            format!(
                "/api/consumers/no_such_consumer_for_matrix/ordered/actions/{}",
                o.as_str()
            ),
            json!({"reason": "matrix", "aggregate_type": "t", "aggregate_id": "a", "version": 1}),
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_action_matrix_over_http_every_refusal_audited() {
    let c = Console::start().await;
    let mut checked = 0;
    for role in Role::ALL {
        let name = format!("matrix-{role}");
        let token = c.user(&name, role).await;
        for action in Action::all() {
            let (path, body) = request_for(action);
            let before = c.audit_count(&name, action.name(), "denied").await;
            let status = match path.strip_prefix("GET ") {
                Some(p) => c.get(&token, p).await.0,
                None => c.post(&token, &path, body, None).await.0,
            };
            let denied = c.audit_count(&name, action.name(), "denied").await;
            if allowed(role, action) {
                assert_ne!(status, StatusCode::FORBIDDEN, "{role} × {}", action.name());
                if let Action::Process(_) = action {
                    // Past the role check, on the processes crate: there is no such process.
                    assert_eq!(status, StatusCode::NOT_FOUND, "{role} × {}", action.name());
                }
                assert!(
                    status != StatusCode::UNAUTHORIZED,
                    "{role} × {}",
                    action.name()
                );
                assert_eq!(
                    denied,
                    before,
                    "{role} × {}: nothing to audit as denied",
                    action.name()
                );
            } else {
                assert_eq!(status, StatusCode::FORBIDDEN, "{role} × {}", action.name());
                assert_eq!(
                    denied,
                    before + 1,
                    "{role} × {}: the 403 is audited",
                    action.name()
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, Role::ALL.len() * Action::all().len());
    // No token, a wrong token: 401 with a JSON error, not a page.
    let r = c.web.anonymous_get("/api/outbox/dead").await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(r.json::<Value>().await.unwrap().get("error").is_some());
    assert_eq!(
        c.get("ct_wrong", "/api/outbox/dead").await.0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_eyes_requester_cannot_approve_a_second_approver_can_and_the_effect_happens_once() {
    let c = Console::start().await;
    let alice = c.user("alice", Role::Approver).await;
    let bob = c.user("bob", Role::Approver).await;
    let carol = c.user("carol", Role::Approver).await;
    let ids = c.dead_rows(2).await;
    let mut items = Vec::new();
    for id in &ids {
        items.push(json!({"id": id, "version": c.version(*id).await}));
    }

    // The dry run says what each would do and changes nothing.
    let (s, plan, _) = c
        .post(
            &alice,
            "/api/outbox/dead/actions/requeue",
            json!({"reason": "look", "items": items, "dry_run": true}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(plan["needs_approval"], json!(true));
    assert!(
        plan["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["would"] == "requeue"),
        "{plan}"
    );

    // Two rows: a request, not an effect.
    let body = c
        .post_expect(
            &alice,
            "/api/outbox/dead/actions/requeue",
            json!({"reason": "gateway fixed", "items": items}),
            None,
            StatusCode::ACCEPTED,
        )
        .await;
    let approval = body["approval"].as_str().unwrap().to_string();
    for id in &ids {
        assert_eq!(c.state(*id).await, "dead");
    }

    // The requester cannot approve (403, audited, nothing changes).
    let path = format!("/api/approvals/{approval}/approve");
    let (s, _, _) = c
        .post(&alice, &path, json!({"reason": "mine", "version": 1}), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(
        c.audit_count("alice", "approval.approve", "denied").await,
        1
    );
    for id in &ids {
        assert_eq!(c.state(*id).await, "dead");
    }

    // Bob and Carol approve at the same moment: exactly one wins.
    let (won, winner_body) = c
        .approve_at_once(
            &path,
            [
                (&bob, "checked", "bob-1"),
                (&carol, "checked too", "carol-1"),
            ],
        )
        .await;
    let (winner, winner_key) = [(&bob, "bob-1"), (&carol, "carol-1")][won];
    for id in &ids {
        assert_eq!(c.state(*id).await, "pending");
    }

    // The rows die again; approving again (same key: replay; new key: 409) must not requeue them.
    sqlx::query("UPDATE outbox.messages SET state = 'dead', attempts = 5 WHERE id = ANY($1)")
        .bind(&ids)
        .execute(&c.db.pool)
        .await
        .unwrap();
    let (s, body, replayed) = c
        .post(
            winner,
            &path,
            json!({"reason": if winner == &bob { "checked" } else { "checked too" }, "version": 1}),
            Some(winner_key),
        )
        .await;
    assert_eq!((s, replayed), (StatusCode::OK, true));
    assert_eq!(body, winner_body);
    let (s, _, _) = c
        .post(
            winner,
            &path,
            json!({"reason": "again", "version": 1}),
            Some("another"),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    for id in &ids {
        assert_eq!(c.state(*id).await, "dead", "approving twice requeued twice");
    }
    // One effect entry per row, naming the requester and the approver.
    let effects: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT actor_name, approver FROM outbox.console_audit WHERE action = 'outbox.requeue' AND outcome = 'succeeded'",
    )
    .fetch_all(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(effects.len(), 2, "{effects:?}");
    assert!(
        effects.iter().all(
            |(a, ap)| a == "alice" && ap.as_deref().is_some_and(|n| n == "bob" || n == "carol")
        )
    );
    assert_eq!(
        c.audit_count("alice", "outbox.requeue", "requested").await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_version_answers_409_and_changes_nothing() {
    let c = Console::start().await;
    let op = c.user("olga", Role::Operator).await;
    let ap = c.user("abe", Role::Approver).await;
    let ids = c.dead_rows(3).await;
    let seen = c.version(ids[0]).await;
    // Someone else changes the row after the operator looked.
    sqlx::query("UPDATE outbox.messages SET last_error = 'changed meanwhile' WHERE id = $1")
        .bind(ids[0])
        .execute(&c.db.pool)
        .await
        .unwrap();
    let body = c
        .post_expect(
            &op,
            &format!("/api/outbox/dead/{}/actions/requeue", ids[0]),
            json!({"reason": "retry", "version": seen}),
            None,
            StatusCode::CONFLICT,
        )
        .await;
    assert!(body.get("error").is_some() && body.as_object().unwrap().len() == 1);
    assert_eq!(c.state(ids[0]).await, "dead");
    assert_eq!(c.audit_count("olga", "outbox.requeue", "conflict").await, 1);
    assert_eq!(
        c.audit_count("olga", "outbox.requeue", "succeeded").await,
        0
    );

    // An approval whose rows changed after the request: 409 on approve, request stays pending.
    let items = json!([{"id": ids[1], "version": c.version(ids[1]).await}, {"id": ids[2], "version": c.version(ids[2]).await}]);
    let (s, body, _) = c
        .post(
            &op,
            "/api/outbox/dead/actions/requeue",
            json!({"reason": "both", "items": items}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let approval = body["approval"].as_str().unwrap().to_string();
    sqlx::query("UPDATE outbox.messages SET attempts = 6 WHERE id = $1")
        .bind(ids[2])
        .execute(&c.db.pool)
        .await
        .unwrap();
    let (s, _) = c.try_approve(&ap, &approval, "ok").await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(
        (c.state(ids[1]).await, c.state(ids[2]).await),
        ("dead".into(), "dead".into())
    );
    assert_eq!(
        consoles::approval_status(&c.db.pool, &approval).await,
        "pending"
    );
    // A stale approval version is a conflict too.
    let (s, _, _) = c
        .post(
            &ap,
            &format!("/api/approvals/{approval}/reject"),
            json!({"reason": "no", "version": 7}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_idempotency_key_replays_and_repeats_no_effect() {
    let c = Console::start().await;
    let op = c.user("otto", Role::Operator).await;
    let id = c.dead_rows(1).await[0];
    let body = json!({"reason": "retry", "version": c.version(id).await});
    let path = format!("/api/outbox/dead/{id}/actions/requeue");
    let (s, first, replayed) = c.post(&op, &path, body.clone(), Some("k-1")).await;
    assert_eq!((s, replayed), (StatusCode::OK, false), "{first}");
    assert_eq!(c.state(id).await, "pending");
    c.make_dead(id).await;
    let (s, again, replayed) = c.post(&op, &path, body.clone(), Some("k-1")).await;
    assert_eq!((s, replayed), (StatusCode::OK, true));
    assert_eq!(again, first);
    assert_eq!(c.state(id).await, "dead", "the replay repeated the effect");
    assert_eq!(
        c.audit_count("otto", "outbox.requeue", "succeeded").await,
        1
    );
    let (s, _, _) = c
        .post(
            &op,
            &path,
            json!({"reason": "other", "version": 1}),
            Some("k-1"),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);

    // A process action: the same key replays, the process changes once.
    let pid = c.process("idempotent-pause").await;
    let version = c.process_view(&op, pid).await["version"].as_i64().unwrap();
    let path = format!("/api/processes/{pid}/actions/pause");
    let body = json!({"reason": "hold", "version": version});
    let (s, first, replayed) = c.post(&op, &path, body.clone(), Some("k-p")).await;
    assert_eq!((s, replayed), (StatusCode::OK, false), "{first}");
    let paused = c.process_state(pid).await;
    assert!(paused.1 && paused.2 == version + 1, "{paused:?}");
    let (s, again, replayed) = c.post(&op, &path, body.clone(), Some("k-p")).await;
    assert_eq!((s, replayed), (StatusCode::OK, true));
    assert_eq!(again, first);
    assert_eq!(
        c.process_state(pid).await,
        paused,
        "the replay repeated the effect"
    );
    assert_eq!(c.audit_count("otto", "process.pause", "succeeded").await, 1);
    // The same key with another request: 422, nothing changes.
    c.post_expect(
        &op,
        &path,
        json!({"reason": "hold longer", "version": version}),
        Some("k-p"),
        StatusCode::UNPROCESSABLE_ENTITY,
    )
    .await;
    assert_eq!(c.process_state(pid).await, paused);
    // The same key on another route is another record (one per operation), and the key of
    // another user never collides: both run.
    let other = c.user("oona", Role::Operator).await;
    let (s, _, replayed) = c
        .post(
            &other,
            &format!("/api/processes/{pid}/actions/resume"),
            json!({"reason": "go on", "version": version + 1}),
            Some("k-p"),
        )
        .await;
    assert_eq!((s, replayed), (StatusCode::OK, false));
    // The records are the idempotency crate's, scoped to the user: the lookup shows them.
    let (_, me) = c.get(&op, "/api/whoami").await;
    let me: Value = serde_json::from_str(&me).unwrap();
    let scope = format!("console-user:{}", me["id"].as_str().unwrap());
    let (s, records, _) = c
        .post(
            &op,
            "/api/idempotency",
            json!({"scope": scope, "key": "k-p"}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let records: Vec<Value> = serde_json::from_value(records).unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        records[0]["operation"],
        json!("console POST /api/processes/{id}/actions/{action}")
    );
    assert_eq!(records[0]["status"], json!("completed"));
    assert_eq!(records[0]["response_status"], json!(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_actions_answer_409_on_a_stale_version_or_when_not_allowed_now_and_change_nothing()
{
    let c = Console::start().await;
    let op = c.user("olaf", Role::Operator).await;
    let id = c.process("stale-1").await;
    let view = c.process_view(&op, id).await;
    assert_eq!(view["status"], json!("pending"));
    let version = view["version"].as_i64().unwrap();
    let names = offered(&view);
    for a in ["pause", "escalate"] {
        assert!(names.iter().any(|n| n == a), "{a} not offered: {names:?}");
    }
    // Not now; and cancel (abandoning effects uncompensated) is not a console action at all.
    for a in ["resume", "run_compensation", "resolve_failed", "cancel"] {
        assert!(!names.iter().any(|n| n == a), "{a} offered: {names:?}");
    }
    let before = c.process_state(id).await;
    let path = |a: &str| format!("/api/processes/{id}/actions/{a}");

    // A stale version: 409, a body with only `error`, nothing changed, the conflict audited.
    let err = c
        .post_expect(
            &op,
            &path("pause"),
            json!({"reason": "hold", "version": version - 1}),
            None,
            StatusCode::CONFLICT,
        )
        .await;
    assert!(err.get("error").is_some() && err.as_object().unwrap().len() == 1);
    assert_eq!(c.process_state(id).await, before);
    assert_eq!(c.audit_count("olaf", "process.pause", "conflict").await, 1);

    // Not allowed now (not paused; nothing to compensate): 409, nothing changed, no request.
    for a in ["resume", "run_compensation"] {
        let (s, err, _) = c
            .post(
                &op,
                &path(a),
                json!({"reason": "try", "version": version}),
                None,
            )
            .await;
        assert_eq!(s, StatusCode::CONFLICT, "{a}: {err}");
        assert!(
            err["error"].as_str().unwrap().contains("not allowed now"),
            "{err}"
        );
        assert_eq!(
            c.audit_count("olaf", &format!("process.{a}"), "conflict")
                .await,
            1
        );
    }
    assert_eq!(c.process_state(id).await, before);
    assert_eq!(c.approvals().await, 0);

    // The version seen: done now, in the process history under the console user's name, and in
    // the audit log with before and after.
    let done = c
        .post_expect(
            &op,
            &path("pause"),
            json!({"reason": "hold for INC-7", "version": version}),
            None,
            StatusCode::OK,
        )
        .await;
    assert_eq!(done["version"], json!(version + 1));
    let after = c.process_state(id).await;
    assert_eq!(
        (after.1, after.2, after.3),
        (true, version + 1, before.3 + 1)
    );
    let (actor, reason): (String, String) = sqlx::query_as(
        "SELECT actor, reason FROM outbox.process_history WHERE process_id = $1 ORDER BY id DESC LIMIT 1",
    )
    .bind(id)
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(actor, "console:olaf");
    assert!(reason.contains("hold for INC-7"), "{reason}");
    let (b, a): (Value, Value) = sqlx::query_as(
        "SELECT before, after FROM outbox.console_audit WHERE action = 'process.pause' AND outcome = 'succeeded'",
    )
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(
        (&b["paused"], &b["version"]),
        (&json!(false), &json!(version))
    );
    assert_eq!(a["version"], json!(version + 1));
    // The version just used is stale now.
    let (s, _, _) = c
        .post(
            &op,
            &path("resume"),
            json!({"reason": "go", "version": version}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(c.process_state(id).await, after);
    // The page offers resume now, and no pause.
    let names = offered(&c.process_view(&op, id).await);
    assert!(names.iter().any(|n| n == "resume") && !names.iter().any(|n| n == "pause"));

    // The list's filters: kind, status, age.
    for (query, listed) in [
        ("?kind=order_key&status=pending", true),
        ("?kind=payment", false),
        ("?status=manual_review", false),
        ("?older_than_seconds=3600", false),
        ("?older_than_seconds=0", true),
    ] {
        let (s, body) = c.get(&op, &format!("/api/processes{query}")).await;
        assert_eq!(s, StatusCode::OK, "{body}");
        assert_eq!(body.contains(&id.to_string()), listed, "{query}: {body}");
    }
}

/// A process worker in this test process, with its own pool, until `shutdown`.
async fn spawn_worker(
    url: &str,
    name: &str,
    registry: processes::Registry,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<Result<(), processes::WorkerError>> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await
        .unwrap();
    let mut config = processes::WorkerConfig::new(pool, Schema::default(), name);
    config.concurrency = 4;
    config.lease = Duration::from_secs(2);
    config.heartbeat = Duration::from_millis(400);
    config.poll_interval = Duration::from_millis(100);
    config.shutdown_grace = Duration::from_secs(5);
    tokio::spawn(processes::Worker::run(config, registry, shutdown))
}

async fn wait_process(pool: &sqlx::PgPool, id: Uuid, want: &str) {
    wait_until(
        &format!("process {id} {want}"),
        Duration::from_secs(90),
        || async move {
            let s: String = sqlx::query_scalar("SELECT status FROM outbox.processes WHERE id = $1")
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap();
            (s == want).then_some(())
        },
    )
    .await;
}

/// An order whose confirmation is refused after the charge, run by a worker in this process: the
/// charge's refund is sensitive and waits in manual review. Returns the process, the worker's
/// shutdown and its task.
async fn refund_in_review(
    c: &Console,
    key: &str,
) -> (
    Uuid,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), processes::WorkerError>>,
) {
    fx::setup(&c.db.pool).await.unwrap();
    let fp = fx::Failpoint::default();
    let d = fx::order_sensitive_refund("order_sensitive", &c.db.pool, &fp);
    let id = processes::start(
        &c.db.pool,
        &d,
        key,
        &json!({"amount": 6396, "currency": "EUR", "charge": "ok", "reject_confirm": true}),
    )
    .await
    .unwrap()
    .id;
    let shutdown = CancellationToken::new();
    let worker = spawn_worker(
        &c.db.url,
        "console-w1",
        fx::registry(&c.db.pool, &fp),
        shutdown.clone(),
    )
    .await;
    wait_process(&c.db.pool, id, "manual_review").await;
    assert_eq!(fx::effects(&c.db.pool, id).await, (1, 0));
    (id, shutdown, worker)
}

/// A refund approved after the process changed (an operator paused it meanwhile) is refused as
/// stale: 409, the approval closed as superseded, no refund, the conflict audited. The database itself
/// refuses an approval decided by its requester (four eyes below the application).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_of_a_process_that_changed_meanwhile_is_refused_and_changes_nothing() {
    let c = Console::start().await;
    let alice = c.user("alice", Role::Approver).await;
    let bob = c.user("bob", Role::Approver).await;
    let (id, shutdown, worker) = refund_in_review(&c, "refund-stale").await;
    let view = c.process_view(&alice, id).await;
    let body = c
        .post_expect(
            &alice,
            &format!("/api/processes/{id}/actions/run_compensation"),
            json!({"reason": "refund it", "version": view["version"]}),
            None,
            StatusCode::ACCEPTED,
        )
        .await;
    let approval = body["approval"].as_str().unwrap().to_string();
    // Meanwhile the process changes: paused.
    let (s, _, _) = c
        .post(
            &bob,
            &format!("/api/processes/{id}/actions/pause"),
            json!({"reason": "hold while we check", "version": view["version"]}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let changed = c.process_state(id).await;

    let (s, body) = c.try_approve(&bob, &approval, "ok").await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    assert_eq!(c.process_state(id).await, changed, "nothing changed");
    assert_eq!(fx::effects(&c.db.pool, id).await, (1, 0), "no refund");
    assert_eq!(
        consoles::approval_status(&c.db.pool, &approval).await,
        "superseded",
        "closed: the process moved on"
    );
    assert!(
        c.audit_count("bob", "approval.approve", "conflict").await >= 1,
        "the refused approval is audited"
    );
    let self_approved = sqlx::query(
        "UPDATE outbox.console_approvals SET status = 'approved', decided_by = requested_by, \
           decided_at = now() WHERE id = $1::uuid",
    )
    .bind(&approval)
    .execute(&c.db.pool)
    .await
    .expect_err("the four-eyes CHECK refuses it");
    assert!(
        self_approved
            .to_string()
            .contains("console_approvals_four_eyes"),
        "{self_approved}"
    );
    shutdown.cancel();
    worker.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_waits_for_a_second_approver_and_runs_once_even_when_approved_twice() {
    let c = Console::start().await;
    let alice = c.user("alice", Role::Approver).await;
    let bob = c.user("bob", Role::Approver).await;
    let carol = c.user("carol", Role::Approver).await;
    let (id, shutdown, worker) = refund_in_review(&c, "refund-once").await;
    // The overview counts it.
    let cookie = login(&c, &alice).await;
    let overview = c.web.web_get(&cookie, "/").await.text().await.unwrap();
    assert!(overview.contains("1 in manual review"), "{overview}");
    let view = c.process_view(&alice, id).await;
    let refund = view["allowed_actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["action"] == "run_compensation")
        .cloned()
        .unwrap_or_else(|| panic!("no refund offered: {view}"));
    assert_eq!(
        (&refund["needs_approval"], &refund["min_role"]),
        (&json!(true), &json!("operator"))
    );
    let step = refund["step"].as_i64().unwrap();
    assert!(
        view["steps"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["seq"] == json!(step)
                && s["role"] == "compensation"
                && s["status"] == "manual_review"),
        "{view}"
    );
    // resolving as succeeded needs evidence, checked when asked, not when approved.
    c.post_expect(
        &alice,
        &format!("/api/processes/{id}/actions/resolve_succeeded"),
        json!({"reason": "refunded by phone", "version": view["version"], "step": step}),
        None,
        StatusCode::BAD_REQUEST,
    )
    .await;
    // Nor evidence longer than the process history keeps (it would fail only at approval time,
    // leaving the approval pending for good).
    c.post_expect(
        &alice,
        &format!("/api/processes/{id}/actions/resolve_succeeded"),
        json!({"reason": "refunded by phone", "version": view["version"], "step": step,
                   "evidence": "ticket ".repeat(100)}),
        None,
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(c.approvals().await, 0);

    // The request (the step left out: only one offers it).
    let body = c
        .post_expect(
            &alice,
            &format!("/api/processes/{id}/actions/run_compensation"),
            json!({"reason": "order refused, refund it", "version": view["version"]}),
            None,
            StatusCode::ACCEPTED,
        )
        .await;
    let approve = format!(
        "/api/approvals/{}/approve",
        body["approval"].as_str().unwrap()
    );
    assert_eq!(c.process_state(id).await.0, "manual_review");
    // Not by the requester.
    let (s, _, _) = c
        .post(
            &alice,
            &approve,
            json!({"reason": "mine", "version": 1}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(c.process_state(id).await.0, "manual_review");
    // Two approvers at once: one wins, the refund runs once.
    let (won, _) = c
        .approve_at_once(&approve, [(&bob, "ok", "b"), (&carol, "ok too", "c")])
        .await;
    let (winner, key) = [(&bob, "b"), (&carol, "c")][won];
    wait_process(&c.db.pool, id, "compensated").await;
    // Approving again, replayed or not, runs nothing more.
    let reason = if key == "b" { "ok" } else { "ok too" };
    let (s, _, replayed) = c
        .post(
            winner,
            &approve,
            json!({"reason": reason, "version": 1}),
            Some(key),
        )
        .await;
    assert_eq!((s, replayed), (StatusCode::OK, true));
    let (s, _, _) = c
        .post(
            winner,
            &approve,
            json!({"reason": "again", "version": 1}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    shutdown.cancel();
    worker.await.unwrap().unwrap();
    assert_eq!(fx::effects(&c.db.pool, id).await, (1, 1), "refunded once");
    let (actor, approver): (String, Option<String>) = sqlx::query_as(
        "SELECT actor_name, approver FROM outbox.console_audit WHERE action = 'process.run_compensation' AND outcome = 'succeeded'",
    )
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(actor, "alice");
    assert!(matches!(approver.as_deref(), Some("bob" | "carol")));
    assert_eq!(
        c.audit_count("alice", "process.run_compensation", "requested")
            .await,
        1
    );
    assert_eq!(
        c.audit_count("alice", "approval.approve", "denied").await,
        1
    );
    let history_actor: String = sqlx::query_scalar(
        "SELECT actor FROM outbox.process_history WHERE process_id = $1 AND actor LIKE 'console:%' ORDER BY id LIMIT 1",
    )
    .bind(id)
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    assert!(
        history_actor.starts_with("console:alice (approved by "),
        "{history_actor}"
    );
}

fn csrf_of(html: &str) -> String {
    let at =
        html.find("name=\"csrf\" value=\"").expect("a csrf field") + "name=\"csrf\" value=\"".len();
    html[at..at + 64].to_string()
}

async fn login(c: &Console, token: &str) -> String {
    let r = c.web.login_with(token).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let set = consoles::session_cookie(&r).expect("a session cookie");
    for attr in ["HttpOnly", "SameSite=Strict", "Max-Age=3600", "Path=/"] {
        assert!(set.contains(attr), "{set} lacks {attr}");
    }
    set.split(';').next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_sessions_csrf_idle_timeout_and_expiry() {
    let c = Console::start().await;
    let op = c.user("wendy", Role::Operator).await;
    let id = c.dead_rows(1).await[0];

    let r = c.web.anonymous_get("/").await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(r.headers()["location"], "/login");

    let cookie = login(&c, &op).await;
    let page = c.web.web_get(&cookie, "/").await;
    assert_eq!(page.status(), StatusCode::OK);
    let html = page.text().await.unwrap();
    let csrf = csrf_of(&html);
    let item = format!("{id}:{}", c.version(id).await);

    // Without the CSRF token: 403, audited, nothing changes.
    let r = c
        .web
        .web_post(
            &cookie,
            "/ui/outbox/requeue",
            &[("item", item.as_str()), ("reason", "retry"), ("go", "1")],
        )
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(c.state(id).await, "dead");
    assert_eq!(c.audit_count("wendy", "outbox.requeue", "denied").await, 1);
    // A wrong one: the same.
    let r = c
        .web
        .web_post(
            &cookie,
            "/ui/outbox/requeue",
            &[
                ("csrf", "0".repeat(64).as_str()),
                ("item", item.as_str()),
                ("reason", "retry"),
                ("go", "1"),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(c.state(id).await, "dead");

    // With it: done, back to the overview.
    let form = [
        ("csrf", csrf.as_str()),
        ("idempotency_key", "form-1"),
        ("item", item.as_str()),
        ("reason", "retry"),
        ("go", "1"),
    ];
    let submit = || c.web.web_post(&cookie, "/ui/outbox/requeue", &form);
    let r = submit().await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(c.state(id).await, "pending");
    // The same form sent again (a double click, a reload): its key replays, nothing runs twice.
    c.make_dead(id).await;
    let r = submit().await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(c.state(id).await, "dead", "the form ran twice");
    assert_eq!(
        c.audit_count("wendy", "outbox.requeue", "succeeded").await,
        1
    );

    // A second session left unused past the idle timeout (30 minutes) ends; the first, in use,
    // goes on (issue 40: sessions never timed out when idle).
    let idle = login(&c, &op).await;
    assert_eq!(c.web.web_get(&idle, "/").await.status(), StatusCode::OK);
    sqlx::query(
        "UPDATE outbox.console_sessions SET last_seen_at = now() - interval '31 minutes' \
         WHERE created_at = (SELECT max(created_at) FROM outbox.console_sessions)",
    )
    .execute(&c.db.pool)
    .await
    .unwrap();
    let r = c.web.web_get(&idle, "/").await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(r.headers()["location"], "/login");
    assert_eq!(c.web.web_get(&cookie, "/").await.status(), StatusCode::OK);

    // The session expires: back to the login page.
    sqlx::query("UPDATE outbox.console_sessions SET created_at = now() - interval '2 hours', expires_at = now() - interval '1 hour'")
        .execute(&c.db.pool)
        .await
        .unwrap();
    let r = c.web.web_get(&cookie, "/").await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    assert_eq!(r.headers()["location"], "/login");

    // A revoked user's token no longer works, nor does a new session.
    console::users::revoke(&c.db.pool, &Schema::default(), "wendy")
        .await
        .unwrap();
    assert_eq!(
        c.get(&op, "/api/outbox/dead").await.0,
        StatusCode::UNAUTHORIZED
    );
    let r = c.web.login_with(op.as_str()).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_are_rate_limited_per_address_without_locking_out_a_right_token() {
    let c = Console::start_with(3, &[]).await;
    let good = c.user("gina", Role::Viewer).await;
    for _ in 0..3 {
        let r = c.web.login_with("ct_wrong").await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    // A wrong token waits now.
    let r = c.web.login_with("ct_wrong_again").await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(consoles::session_cookie(&r).is_none());
    // The right token of someone behind the same address is not locked out by them (issue 40:
    // five wrong tries locked out every user behind one address).
    let r = c.web.login_with(good.as_str()).await;
    assert!(r.status().is_redirection(), "{}", r.status());
    assert!(consoles::session_cookie(&r).is_some());
    let metrics = c.web.anonymous_get("/metrics").await.text().await.unwrap();
    assert!(
        metrics.contains("console_login_failures_total{reason=\"rate_limited\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("console_login_failures_total{reason=\"invalid_token\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_card_number_or_declared_secret_in_any_page_or_response() {
    let c = Console::start().await;
    let admin = c.user("ada", Role::Admin).await;
    let op = c.user("oscar", Role::Operator).await;
    let viewer = c.user("vic", Role::Viewer).await;
    let ids = c.dead_rows(3).await;
    // Actions whose reasons carry a card number and a token.
    let reason = format!("customer read {CARD} and pasted {op}");
    let (s, _, _) = c
        .post(
            &op,
            &format!("/api/outbox/dead/{}/actions/requeue", ids[0]),
            json!({"reason": reason, "version": c.version(ids[0]).await}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let items = json!([{"id": ids[1], "version": c.version(ids[1]).await}, {"id": ids[2], "version": c.version(ids[2]).await}]);
    let (s, _, _) = c
        .post(
            &op,
            "/api/outbox/dead/actions/requeue",
            json!({"reason": reason, "items": items}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    // A stale attempt: its error text carries no secret either.
    let (s, err, _) = c
        .post(
            &viewer,
            &format!("/api/outbox/dead/{}/actions/requeue", ids[0]),
            json!({"reason": reason, "version": 1}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // A process whose input carries the card number, paused with that reason.
    let pid = c.process("redaction").await;
    let version = c.process_view(&op, pid).await["version"].as_i64().unwrap();
    let (s, _, _) = c
        .post(
            &op,
            &format!("/api/processes/{pid}/actions/pause"),
            json!({"reason": reason, "version": version}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);

    let cookie = login(&c, &admin).await;
    let mut seen = vec![err.to_string()];
    let process_api = format!("/api/processes/{pid}");
    for token in [&admin, &viewer] {
        for path in [
            "/api/outbox/dead",
            "/api/outbox/backlog",
            "/api/audit",
            "/api/audit?format=jsonl",
            "/api/approvals",
            "/api/whoami",
            "/api/openapi.json",
            "/api/processes",
            process_api.as_str(),
        ] {
            let (s, body) = c.get(token, path).await;
            assert_eq!(s, StatusCode::OK, "{path}");
            seen.push(body);
        }
    }
    let process_page = format!("/processes/{pid}");
    for path in [
        "/",
        "/audit",
        "/processes",
        process_page.as_str(),
        "/idempotency",
        "/dead-letters",
    ] {
        let r = c.web.web_get(&cookie, path).await;
        assert_eq!(r.status(), StatusCode::OK, "{path}");
        seen.push(r.text().await.unwrap());
    }
    // The rows still hold the secrets (the database is not redacted, only what leaves the console).
    let raw: String = sqlx::query_scalar("SELECT payload::text FROM outbox.messages WHERE id = $1")
        .bind(ids[0])
        .fetch_one(&c.db.pool)
        .await
        .unwrap();
    assert!(raw.contains(CARD) && raw.contains(SECRET));
    let all = seen.join("\n");
    assert!(all.contains("payment.captured"), "the pages show the rows");
    assert!(
        all.contains("order_key") && all.contains(&pid.to_string()),
        "and the process"
    );
    assert!(all.contains("[redacted]"));
    for secret in [
        CARD,
        "4111 1111 1111 1111",
        SECRET,
        admin.as_str(),
        op.as_str(),
        viewer.as_str(),
    ] {
        assert!(!all.contains(secret), "{secret} leaked");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_table_refuses_update_delete_and_truncate_and_only_the_purge_removes_old_rows() {
    let c = Console::start().await;
    let admin = c.user("adam", Role::Admin).await;
    let insert = "INSERT INTO outbox.console_audit (at, actor_name, roles, action, target, reason, outcome) \
                  VALUES (now() - make_interval(days => $1), 'x', '{viewer}', 'read', 't', 'r', 'succeeded')";
    sqlx::query(insert)
        .bind(400)
        .execute(&c.db.pool)
        .await
        .unwrap();
    sqlx::query(insert)
        .bind(10)
        .execute(&c.db.pool)
        .await
        .unwrap();
    for sql in [
        "UPDATE outbox.console_audit SET reason = 'rewritten'",
        "DELETE FROM outbox.console_audit",
        "DELETE FROM outbox.console_audit WHERE at < now() - interval '365 days'",
        "TRUNCATE outbox.console_audit",
    ] {
        let e = sqlx::query(sql).execute(&c.db.pool).await.expect_err(sql);
        assert!(e.to_string().contains("append-only"), "{sql}: {e}");
    }
    // A session setting alone does not open the door to younger rows.
    let mut tx = c.db.pool.begin().await.unwrap();
    sqlx::query("SELECT set_config('outbox_console.audit_purge_before', (now() - interval '365 days')::text, true)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let e = sqlx::query("DELETE FROM outbox.console_audit WHERE at > now() - interval '30 days'")
        .execute(&mut *tx)
        .await;
    assert!(e.is_err());
    drop(tx);
    // The admin's purge removes exactly the entry older than a year, and is audited itself.
    let body = c
        .post_expect(
            &admin,
            "/api/audit/actions/purge",
            json!({"reason": "retention"}),
            None,
            StatusCode::OK,
        )
        .await;
    assert_eq!(body["removed"], json!(1));
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.console_audit")
        .fetch_one(&c.db.pool)
        .await
        .unwrap();
    assert_eq!(left, 2, "the young entry and the purge's own entry");
    assert_eq!(c.audit_count("adam", "audit.purge", "succeeded").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_creates_users_with_a_token_on_the_last_line_and_talks_to_the_api() {
    let c = Console::start().await;
    let ids = c.dead_rows(1).await;
    let out = std::process::Command::new(bin_path("console"))
        .args(["user", "create", "--name", "cli-op", "--role", "operator"])
        .env("DATABASE_URL", &c.db.url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let token = stdout.lines().last().unwrap().to_string();
    assert!(token.starts_with("ct_") && token.len() == 67, "{stdout}");
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.console_users WHERE token_hash = sha256($1::bytea)",
    )
    .bind(token.as_bytes())
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(stored, 1, "stored as its SHA-256");

    let cli = |args: &[&str]| c.cli(&token, args);
    let list = cli(&["dead", "list"]);
    assert!(list.status.success());
    let text = String::from_utf8(list.stdout).unwrap();
    // A line's first word is the item as requeue takes it (issue 40: the lists did not paste).
    let item = text
        .lines()
        .find(|l| l.starts_with(&ids[0].to_string()))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("{text}"))
        .to_string();
    let version = c.version(ids[0]).await;
    assert_eq!(item, format!("{}:{version}", ids[0]));
    let r = cli(&["dead", "requeue", "--reason", "from the cli", &item]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(c.state(ids[0]).await, "pending");
    // Processes: list, show (with the actions allowed now), act.
    let pid = c.process("cli").await;
    let list = cli(&["process", "list", "--status", "pending"]);
    assert!(list.status.success());
    assert!(
        String::from_utf8(list.stdout)
            .unwrap()
            .contains(&pid.to_string())
    );
    let show = cli(&["process", "show", &pid.to_string()]);
    assert!(show.status.success());
    let text = String::from_utf8(show.stdout).unwrap();
    assert!(
        text.contains("allowed now:") && text.contains("  pause  (role operator)"),
        "{text}"
    );
    assert!(!text.contains(CARD), "{text}");
    let version = c.process_state(pid).await.2.to_string();
    let pid_s = pid.to_string();
    let act = |version: &str| {
        cli(&[
            "process",
            "act",
            &pid_s,
            "pause",
            "--reason",
            "from the cli",
            "--version",
            version,
        ])
    };
    let r = act(&version);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(c.process_state(pid).await.1, "paused");
    // The same version again is stale: the command fails with the console's reason.
    let r = act(&version);
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("409"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    let export = cli(&["audit", "export"]);
    let lines: Vec<Value> = String::from_utf8(export.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["reason"] == "from the cli" && l["actor_name"] == "cli-op")
    );
    // The token is refused once revoked.
    let out = std::process::Command::new(bin_path("console"))
        .args(["user", "revoke", "--name", "cli-op"])
        .env("DATABASE_URL", &c.db.url)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!cli(&["dead", "list"]).status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_readiness_and_openapi() {
    let c = Console::start().await;
    let op = c.user("mo", Role::Operator).await;
    let id = c.dead_rows(1).await[0];
    let (s, _, _) = c
        .post(
            &op,
            &format!("/api/outbox/dead/{id}/actions/requeue"),
            json!({"reason": "m", "version": c.version(id).await}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    for path in ["/healthz", "/readyz"] {
        assert_eq!(
            c.web.anonymous_get(path).await.status(),
            StatusCode::OK,
            "{path}"
        );
    }
    let m = c.web.anonymous_get("/metrics").await.text().await.unwrap();
    assert!(
        m.contains("console_actions_total{action=\"outbox.requeue\",outcome=\"succeeded\"}"),
        "{m}"
    );
    assert!(m.contains("console_approvals_pending"));
    let doc: Value = c
        .web
        .anonymous_get("/api/openapi.json")
        .await
        .json()
        .await
        .unwrap();
    for p in [
        "/api/outbox/dead",
        "/api/processes/{id}/actions/{action}",
        "/api/approvals/{id}/approve",
        "/api/audit",
    ] {
        assert!(
            doc["paths"].get(p).is_some(),
            "{p} missing from the OpenAPI document"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// A real browser.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_an_operator_requests_a_bulk_requeue_and_an_approver_approves() {
    let c = Console::start().await;
    let op = c.user("operator-olivia", Role::Operator).await;
    let ap = c.user("approver-arthur", Role::Approver).await;
    let ids = c.dead_rows(3).await;
    let (_driver, b) = chromedriver().await;

    // The operator logs in and finds the dead rows.
    log_in(&b, &c.web.base, &op).await;
    wait_for(&b, "dead-rows").await;
    let source = b.source().await.unwrap();
    for id in &ids {
        assert!(source.contains(&id.to_string()));
    }
    assert!(!source.contains(CARD));
    // Selects two, gives a reason, requests the requeue.
    for id in &ids[..2] {
        click(&b, &format!("item-{id}")).await;
    }
    type_into(&b, "requeue-reason", "gateway outage over, INC-42").await;
    follow(&b, "requeue-submit").await;
    let notice = wait_for(&b, "notice").await.text().await.unwrap();
    assert!(notice.contains("approval request"), "{notice}");
    let source = b.source().await.unwrap();
    assert!(
        source.contains("waiting for another approver"),
        "the requester is offered no approve button"
    );
    for id in &ids[..2] {
        assert_eq!(c.state(*id).await, "dead");
    }
    log_out(&b).await;

    // The approver logs in and approves.
    type_into(&b, "token", &ap).await;
    follow(&b, "login").await;
    wait_for(&b, "approvals").await;
    let approval: Uuid =
        sqlx::query_scalar("SELECT id FROM outbox.console_approvals WHERE status = 'pending'")
            .fetch_one(&c.db.pool)
            .await
            .unwrap();
    type_into(
        &b,
        &format!("approval-reason-{approval}"),
        "checked the gateway",
    )
    .await;
    follow(&b, &format!("approve-{approval}")).await;
    let notice = wait_for(&b, "notice").await.text().await.unwrap();
    assert!(notice.contains("approved"), "{notice}");

    // The page shows the rows requeued and both audit entries.
    let source = b.source().await.unwrap();
    let dead_table = text_of(&b, "dead-rows").await;
    assert!(
        !dead_table.contains(&ids[0].to_string()) && !dead_table.contains(&ids[1].to_string()),
        "{dead_table}"
    );
    assert!(
        dead_table.contains(&ids[2].to_string()),
        "the unselected row stays dead"
    );
    let audit = text_of(&b, "audit").await;
    assert_names_each(
        &audit,
        &[
            (
                "operator-olivia",
                "requested",
                "gateway outage over, INC-42",
            ),
            ("approver-arthur", "approved", "checked the gateway"),
        ],
    );
    assert!(
        source.contains(&format!("outbox:{}", ids[0]))
            && source.contains(&format!("outbox:{}", ids[1]))
    );
    for id in &ids[..2] {
        assert_eq!(c.state(*id).await, "pending");
    }
    screenshot_and_close(b, "console-browser.png").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_dead_letters_listed_redacted_replayed_one_now_and_two_after_approval() {
    let dl = DeadLetters::declare("console.dlq", "console.events", None).await;
    let name = &dl.name;
    let c = Console::start_with(5, &[name]).await;
    let op = c.user("dora", Role::Operator).await;
    let ap = c.user("dan", Role::Approver).await;
    let ids: Vec<String> = (0..3).map(|_| Uuid::new_v4().to_string()).collect();
    let reason = format!("card {CARD} refused");
    let body = json!({"card_number": CARD, "customer_secret": SECRET, "amount": 5}).to_string();
    for id in &ids {
        let headers = [
            (consumer::message::headers::DEAD_LETTER_KIND, "permanent"),
            (consumer::message::headers::DEAD_LETTER_REASON, &reason),
            (
                consumer::message::headers::DEAD_LETTERED_AT,
                "2026-12-01T10:00:00Z",
            ),
        ];
        dl.publish(id, "payment.captured", &headers, body.as_bytes())
            .await;
    }

    let (s, listed) = c
        .get(&op, &format!("/api/dead-letters?consumer={name}"))
        .await;
    assert_eq!(s, StatusCode::OK, "{listed}");
    for secret in [CARD, SECRET] {
        assert!(!listed.contains(secret), "{secret} leaked: {listed}");
    }
    let page: Value = serde_json::from_str(&listed).unwrap();
    let letters = page["items"].as_array().unwrap();
    assert_eq!(letters.len(), 3);
    assert_eq!(page["total"], json!(3), "the queue's depth");
    assert!(
        letters
            .iter()
            .all(|l| l["version"] == "2026-12-01T10:00:00Z" && l["kind"] == "permanent")
    );

    // CONSOLE_CONSUMERS is an allowlist: the dead letters of a consumer not listed there cannot be
    // browsed or replayed, even when its dead-letter queue exists (404, as for no queue at all).
    let unlisted = dl.broker.queue("console.unlisted");
    system_tests::consumers::track_consumer(&dl.broker, &unlisted, &[], None);
    consumer::Topology::new(&unlisted, &[])
        .declare(&dl.conn, &dl.exchange, &[])
        .await
        .unwrap();
    for consumer in [unlisted.as_str(), "no_such_consumer"] {
        let (s, body) = c
            .get(&op, &format!("/api/dead-letters?consumer={consumer}"))
            .await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{consumer}: {body}");
        let (s, body, _) = c
            .post(
                &op,
                &format!("/api/dead-letters/{consumer}/actions/replay"),
                json!({"reason": "r", "items": [{"message_id": ids[0], "version": "2026-12-01T10:00:00Z"}]}),
                None,
            )
            .await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{consumer}: {body}");
    }

    let path = format!("/api/dead-letters/{name}/actions/replay");
    // A stale version: 409, nothing replayed.
    let (s, _, _) = c
        .post(
            &op,
            &path,
            json!({"reason": "r", "items": [{"message_id": ids[0], "version": "older"}]}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    // One: now, from the CLI, with the first word of its line in the CLI's list (issue 40: the
    // list printed `ID version=V` where replay wants `ID=V`).
    let cli = |args: &[&str]| {
        let out = c.cli(&op, args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?}: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let list = cli(&["dlq", "list", "--consumer", name]);
    let item = list
        .lines()
        .find(|l| l.starts_with(&ids[0].to_string()))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("{list}"))
        .to_string();
    assert_eq!(item, format!("{}=2026-12-01T10:00:00Z", ids[0]));
    cli(&[
        "dlq",
        "replay",
        "--consumer",
        name,
        "--reason",
        "handler fixed",
        &item,
    ]);
    wait_until(
        "one message back in the queue",
        Duration::from_secs(30),
        || async { (dl.depth(name).await == 1).then_some(()) },
    )
    .await;
    // Two: an approval request, then the approver's approval replays both.
    let items = json!([{"message_id": ids[1], "version": "2026-12-01T10:00:00Z"}, {"message_id": ids[2], "version": "2026-12-01T10:00:00Z"}]);
    let body = c
        .post_expect(
            &op,
            &path,
            json!({"reason": "the rest", "items": items}),
            None,
            StatusCode::ACCEPTED,
        )
        .await;
    assert_eq!(dl.depth(&dl.topology.dead_letter_queue).await, 2);
    // A dead letter's page (issue 40, item 4): the list links to it; every header, the body
    // pretty, redacted; its replay form; the request that names it.
    let cookie = login(&c, &op).await;
    let list = c
        .web
        .web_get(&cookie, &format!("/dead-letters?consumer={name}"))
        .await
        .text()
        .await
        .unwrap();
    let link = format!("/dead-letters/{name}/{}", ids[1]);
    assert!(list.contains(&format!("href=\"{link}\"")), "{list}");
    let r = c.web.web_get(&cookie, &link).await;
    assert_eq!(r.status(), StatusCode::OK);
    let page = r.text().await.unwrap();
    for part in [
        "payment.captured",
        "refused",
        "id=\"dead-letter-headers\"",
        "2026-12-01T10:00:00Z",
        "id=\"letter-pretty\"",
        "\n  &quot;amount&quot;: 5",
        "id=\"dead-letter-replay\"",
        ">requested<",
    ] {
        assert!(page.contains(part), "{part} in {page}");
    }
    for secret in [CARD, SECRET] {
        assert!(!page.contains(secret), "{secret} leaked: {page}");
    }
    let approval = body["approval"].as_str().unwrap().to_string();
    c.approve(&ap, &approval).await;
    dl.wait_replayed(3).await;
    assert_eq!(c.audit_count("dora", "dlq.replay", "succeeded").await, 3);
    assert_eq!(c.audit_count("dora", "dlq.replay", "conflict").await, 1);
    dl.close().await;
}

/// Consumer `name`'s dead letters on a broker of the test's own: the consumer's plain topology
/// declared on a fresh outbox exchange, and a confirming channel to publish dead letters on. The
/// broker forgets all of it when dropped.
struct DeadLetters {
    conn: lapin::Connection,
    ch: lapin::Channel,
    topology: consumer::Topology,
    name: String,
    exchange: String,
    broker: system_tests::TestBroker,
}

impl DeadLetters {
    /// A fresh consumer named after `queue` (with `partitions` when ordered, tracked as such) on a
    /// fresh outbox exchange named after `exchange`.
    async fn declare(queue: &str, exchange: &str, partitions: Option<u16>) -> Self {
        let broker = system_tests::TestBroker::new();
        let name = broker.queue(queue);
        system_tests::consumers::track_consumer(&broker, &name, &[], partitions);
        let exchange = broker.outbox_exchange(exchange);
        let topology = consumer::Topology::new(&name, &[]);
        let conn = broker.connect().await;
        topology.declare(&conn, &exchange, &[]).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        Self {
            conn,
            ch,
            topology,
            name,
            exchange,
            broker,
        }
    }

    /// Messages in queue `q` now (`u32::MAX` when it cannot be inspected).
    async fn depth(&self, q: &str) -> u32 {
        plumbing::amqp::inspect_queue(&self.conn, q)
            .await
            .map(|q| q.message_count())
            .unwrap_or(u32::MAX)
    }

    /// Waits until all `n` dead letters are back in the consumer's queue and none is left in its
    /// dead-letter queue.
    async fn wait_replayed(&self, n: u32) {
        wait_until(
            &format!("all {n} back in the queue"),
            Duration::from_secs(30),
            || async {
                (self.depth(&self.name).await == n
                    && self.depth(&self.topology.dead_letter_queue).await == 0)
                    .then_some(())
            },
        )
        .await;
    }

    /// Publishes `body` straight into the dead-letter queue (and waits for the broker's confirm),
    /// as message `id` of type `event_type` with the dead-letter `headers` the consumer runtime
    /// would have set.
    async fn publish(&self, id: &str, event_type: &str, headers: &[(&str, &str)], body: &[u8]) {
        let mut h = lapin::types::FieldTable::default();
        for (k, v) in headers {
            consumer::message::set_text(&mut h, k, v);
        }
        self.ch
            .basic_publish(
                "".into(),
                self.topology.dead_letter_queue.as_str().into(),
                lapin::options::BasicPublishOptions::default(),
                body,
                lapin::BasicProperties::default()
                    .with_message_id(id.into())
                    .with_type(event_type.into())
                    .with_headers(h),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Closes the connection (the broker's cleanup still waits for the drop).
    async fn close(&self) {
        let _ = self.conn.close(200, "done".into()).await;
    }
}

/// An ordered consumer's dead letters are listed, but a replay (dry run, one now, or several for
/// approval) answers 409 with only an `error` that says why and what to do instead; the letter
/// stays in the dead-letter queue and nothing reaches the consumer's plain queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_consumers_dead_letters_are_listed_but_replay_answers_409() {
    // The topology an ordered consumer declares: its plain queues and its partition routing.
    let dl = DeadLetters::declare("console.ord", "console.events", Some(2)).await;
    let name = &dl.name;
    consumer::ordered::topology::declare(&dl.conn, &dl.exchange, name, 2, &["#".to_string()])
        .await
        .unwrap();
    let c = Console::start_with(5, &[name]).await;
    let op = c.user("olga", Role::Operator).await;
    let ids: Vec<String> = (0..2).map(|_| Uuid::new_v4().to_string()).collect();
    let headers = [
        (consumer::message::headers::DEAD_LETTER_KIND, "operator"),
        (
            consumer::message::headers::DEAD_LETTERED_AT,
            "2026-12-01T10:00:00Z",
        ),
    ];
    for id in &ids {
        dl.publish(id, "thing.changed", &headers, b"{}").await;
    }
    let (s, listed) = c
        .get(&op, &format!("/api/dead-letters?consumer={name}"))
        .await;
    assert_eq!(s, StatusCode::OK, "{listed}");
    assert_eq!(
        serde_json::from_str::<Value>(&listed).unwrap()["items"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    let path = format!("/api/dead-letters/{name}/actions/replay");
    let item = |i: usize| json!({"message_id": ids[i], "version": "2026-12-01T10:00:00Z"});
    for body in [
        json!({"reason": "look", "items": [item(0)], "dry_run": true}),
        json!({"reason": "fixed", "items": [item(0)]}),
        json!({"reason": "fixed", "items": [item(0), item(1)]}),
    ] {
        let (s, answer, _) = c.post(&op, &path, body.clone(), None).await;
        assert_eq!(s, StatusCode::CONFLICT, "{body}: {answer}");
        let fields: Vec<&String> = answer.as_object().unwrap().keys().collect();
        assert_eq!(fields, ["error"], "{answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(
            error.contains("ordered consumer") && error.contains("publish a new event"),
            "{error}"
        );
    }
    for (queue, want) in [
        (dl.topology.dead_letter_queue.clone(), 2),
        (name.clone(), 0),
    ] {
        let n = plumbing::amqp::inspect_queue(&dl.conn, &queue)
            .await
            .map(|q| q.message_count())
            .unwrap();
        assert_eq!(n, want, "{queue}");
    }
    dl.close().await;
}

/// The demo's payment flow on the console's database: the payment-provider simulator (a child
/// process), the demo API and a payment worker (both in this process).
struct Payments {
    _provider: tokio::process::Child,
    admin: payment_provider::client::Client,
    api: system_tests::demo_stack::ApiClient,
    shutdown: CancellationToken,
}

impl Drop for Payments {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Payments {
    /// Charges are made at once but answered 3 s late (`timeout_after_charge`): past the worker's
    /// 1 s limit, so the charge's outcome stays unknown (retried with the same key) until the test
    /// clears the fault.
    async fn start(db: &TestDb) -> Self {
        Self::start_with(db, 30).await
    }

    /// [`Payments::start`] with the charge tried at most `max_attempts` times: then, its outcome
    /// still unknown, it waits in manual review.
    async fn start_with(db: &TestDb, max_attempts: i32) -> Self {
        let (provider, url) = system_tests::demo_stack::spawn_provider(
            db,
            &[
                ("PROVIDER_FAULTS", "timeout_after_charge:100"),
                ("PROVIDER_TIMEOUT_DELAY", "3s"),
            ],
        )
        .await;
        let shutdown = CancellationToken::new();
        let (api, key) = system_tests::demo_stack::start_api(
            db,
            processes::Remote::HonoursKey,
            shutdown.clone(),
        )
        .await;
        let call_timeout = Duration::from_secs(1);
        let flow = demo::payment_process::PaymentFlow {
            schema: Schema::default(),
            remote: processes::Remote::HonoursKey,
            provider: Some(payment_provider::client::Client::new(&url, call_timeout).unwrap()),
            call_timeout,
            retry: processes::RetryPolicy::default()
                .max_attempts(max_attempts)
                .initial(Duration::from_millis(100))
                .max_delay(Duration::from_millis(800)),
            confirmation_timeout: Duration::from_secs(60),
            dependency: None,
        };
        let registry = processes::Registry::new()
            .with(demo::payment_process::definition(&flow))
            .unwrap();
        spawn_worker(&db.url, "payment-worker", registry, shutdown.clone()).await;
        Self {
            _provider: provider,
            admin: payment_provider::client::Client::new(&url, Duration::from_secs(30)).unwrap(),
            api: system_tests::demo_stack::ApiClient::new(api, key),
            shutdown,
        }
    }

    async fn post(&self, path: &str, key: &str, body: Value) -> Value {
        let r = self.api.post(path, key, &body.to_string(), &[]).await;
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.unwrap()
    }

    /// Places an order of `quantity` × sku-1 at `unit_price` for `customer` and requests its
    /// payment (idempotency keys `order-{key}` and `pay-{key}`): (order id, payment id).
    async fn order_and_pay(
        &self,
        key: &str,
        customer: &str,
        quantity: i64,
        unit_price: i64,
    ) -> (Uuid, String) {
        let items = json!([{"sku": "sku-1", "quantity": quantity, "unit_price": unit_price}]);
        let order = self
            .post(
                "/orders",
                &format!("order-{key}"),
                json!({"customer_id": customer, "currency": "EUR", "items": items}),
            )
            .await;
        let order_id: Uuid = order["id"].as_str().unwrap().parse().unwrap();
        let amount = quantity * unit_price;
        let payment = self
            .post(
                "/payments",
                &format!("pay-{key}"),
                json!({"order_id": order_id, "amount": amount, "currency": "EUR"}),
            )
            .await;
        (order_id, payment["id"].as_str().unwrap().to_string())
    }

    /// The provider's charges for `payment`.
    async fn charges(&self, payment: &str) -> Vec<payment_provider::api::Charge> {
        self.admin
            .admin_charges()
            .await
            .unwrap()
            .into_iter()
            .filter(|c| c.reference == payment)
            .collect()
    }
}

/// Asserts that `text` holds each `(who, outcome, reason)`: all three of an entry somewhere in it.
fn assert_names_each(text: &str, entries: &[(&str, &str, &str)]) {
    for (who, outcome, reason) in entries {
        assert!(
            text.contains(who) && text.contains(outcome) && text.contains(reason),
            "{who} {outcome}: {text}"
        );
    }
}

/// What the browser shows in element `id`.
async fn text_of(b: &fantoccini::Client, id: &str) -> String {
    b.find(fantoccini::Locator::Id(id))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn log_in(b: &fantoccini::Client, base: &str, token: &str) {
    b.goto(&format!("{base}/login")).await.unwrap();
    wait_for(b, "token").await.send_keys(token).await.unwrap();
    follow(b, "login").await;
    wait_for(b, "whoami").await;
}

async fn log_out(b: &fantoccini::Client) {
    follow(b, "logout").await;
    wait_for(b, "token").await;
}

/// Saves the page as `target/<file>` and checks it is a PNG; closes the browser.
async fn screenshot_and_close(b: fantoccini::Client, file: &str) {
    let png = b.screenshot().await.unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target")
        .join(file);
    std::fs::write(&path, &png).unwrap();
    assert!(
        png.starts_with(b"\x89PNG"),
        "a PNG screenshot at {}",
        path.display()
    );
    b.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_an_operator_requests_a_refund_and_an_approver_approves_it() {
    use fantoccini::Locator;
    use payment_provider::api::ChargeStatus;
    let c = Console::start().await;
    let op = c.user("operator-olivia", Role::Operator).await;
    let ap = c.user("approver-arthur", Role::Approver).await;
    let pay = Payments::start(&c.db).await;

    // A payment whose order support cancels while the charge's answer is outstanding: charged,
    // the capture refused, the (sensitive) refund waits in manual review.
    let (order_id, payment) = pay.order_and_pay("1", "cust-1", 2, 250).await;
    wait_until("the provider charged", Duration::from_secs(90), || async {
        (!pay.charges(&payment).await.is_empty()).then_some(())
    })
    .await;
    system_tests::demo_stack::cancel_order(&c.db, order_id).await;
    pay.admin.set_faults("").await.unwrap();
    let pid: Uuid = sqlx::query_scalar(
        "SELECT id FROM outbox.processes WHERE kind = 'payment' AND business_key = $1",
    )
    .bind(&payment)
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    wait_process(&c.db.pool, pid, "manual_review").await;
    let view = c.process_view(&op, pid).await;
    let step = view["allowed_actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["action"] == "run_compensation")
        .and_then(|a| a["step"].as_i64())
        .unwrap_or_else(|| panic!("no refund offered: {view}"));
    let slug = format!("run_compensation-{step}");

    // The operator logs in and finds the payment in manual review, first in the list.
    let (_driver, b) = chromedriver().await;
    log_in(&b, &c.web.base, &op).await;
    b.find(Locator::LinkText("Processes"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(&b, "processes").await;
    let first = b
        .find(Locator::Css("#processes tr.process"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        first.contains(&pid.to_string()) && first.contains("manual_review"),
        "{first}"
    );
    follow(&b, &format!("process-{pid}")).await;
    wait_for(&b, "steps").await;
    assert_eq!(text_of(&b, "process-status").await, "manual_review");
    assert_eq!(
        text_of(&b, &format!("step-{step}-status")).await,
        "manual_review"
    );
    let source = b.source().await.unwrap();
    assert!(
        source.contains("charged, but the order is cancelled now"),
        "the last classified error is shown"
    );
    // Only the actions allowed now, and only those an operator may ask for as forms.
    assert!(source.contains(&format!("action-{slug}")));
    assert!(
        !source.contains("id=\"action-resolve_failed") && source.contains("offered-resolve_failed"),
        "resolving is an approver's"
    );
    assert!(!source.contains("action-escalate") && !source.contains("action-resume"));
    // Requests the refund with a reason.
    type_into(
        &b,
        &format!("reason-{slug}"),
        "order cancelled by support, INC-77: refund the customer",
    )
    .await;
    follow(&b, &format!("action-{slug}")).await;
    let notice = wait_for(&b, "notice").await.text().await.unwrap();
    assert!(notice.contains("approval request"), "{notice}");
    assert!(
        b.source()
            .await
            .unwrap()
            .contains("waiting for another approver")
    );
    let charges = pay.charges(&payment).await;
    assert_eq!(
        (charges.len(), charges[0].status),
        (1, ChargeStatus::Succeeded),
        "no refund before the approval"
    );
    log_out(&b).await;

    // The approver logs in, opens the process and approves.
    log_in(&b, &c.web.base, &ap).await;
    b.goto(&format!("{}/processes/{pid}", c.web.base))
        .await
        .unwrap();
    let approval: Uuid =
        sqlx::query_scalar("SELECT id FROM outbox.console_approvals WHERE status = 'pending'")
            .fetch_one(&c.db.pool)
            .await
            .unwrap();
    wait_for(&b, &format!("approval-reason-{approval}"))
        .await
        .send_keys("checked the order: cancelled, refund due")
        .await
        .unwrap();
    follow(&b, &format!("approve-{approval}")).await;
    let notice = wait_for(&b, "notice").await.text().await.unwrap();
    assert!(notice.contains("approved"), "{notice}");

    // The worker refunds; the page shows the compensation step succeeded and both entries.
    wait_until(
        "the page shows the refund succeeded and the process compensated",
        Duration::from_secs(90),
        || async {
            b.refresh().await.unwrap();
            wait_for(&b, "steps").await;
            let step_status = text_of(&b, &format!("step-{step}-status")).await;
            let status = text_of(&b, "process-status").await;
            (step_status == "succeeded" && status == "compensated").then_some(())
        },
    )
    .await;
    let actions = text_of(&b, "process-audit").await;
    let entries = [
        (
            "operator-olivia",
            "requested",
            "order cancelled by support, INC-77",
        ),
        (
            "approver-arthur",
            "approved",
            "checked the order: cancelled, refund due",
        ),
    ];
    for (who, outcome, reason) in entries {
        assert!(
            actions
                .lines()
                .any(|l| l.contains(who) && l.contains(outcome) && l.contains(reason)),
            "{who} {outcome}: {actions}"
        );
    }
    // The full history sits behind the step strip: open it to read it.
    click(&b, "history-toggle").await;
    let timeline = text_of(&b, "timeline").await;
    assert_names_each(&timeline, &entries);
    assert!(
        timeline.contains("console:operator-olivia (approved by console:approver-arthur)"),
        "the transition names who asked and who approved: {timeline}"
    );
    assert!(
        b.find(Locator::Id("no-actions")).await.is_ok(),
        "a compensated process offers nothing"
    );
    let charges = pay.charges(&payment).await;
    assert_eq!(
        (charges.len(), charges[0].status),
        (1, ChargeStatus::Refunded)
    );
    assert_eq!(
        c.audit_count("operator-olivia", "process.run_compensation", "requested")
            .await,
        1
    );
    assert_eq!(
        c.audit_count("approver-arthur", "approval.approve", "approved")
            .await,
        1
    );
    // The whole page, timeline included.
    b.set_window_size(1400, 2600).await.unwrap();
    screenshot_and_close(b, "console-process.png").await;
}

/// Every error the API answers, whoever produced it (the console, the idempotency layer, axum's
/// own extractors and method routing), is a JSON object whose only field is `error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_error_is_a_json_object_with_only_error() {
    let c = Console::start().await;
    let op = c.user("otto", Role::Operator).await;
    let viewer = c.user("vic", Role::Viewer).await;
    let id = c.process("errors-1").await;
    let version = c.process_view(&op, id).await["version"].as_i64().unwrap();
    let action = |a: &str| format!("/api/processes/{id}/actions/{a}");
    let pause = json!({"reason": "hold", "version": version});
    // A key used once, then reused with another body below.
    let (s, _, _) = c
        .post(&op, &action("pause"), pause.clone(), Some("k-1"))
        .await;
    assert_eq!(s, StatusCode::OK);

    /// (what, method, path, token, body, Idempotency-Key, expected status)
    type Case<'a> = (
        &'a str,
        reqwest::Method,
        String,
        Option<&'a str>,
        Option<Value>,
        Option<&'a str>,
        u16,
    );
    let cases: Vec<Case> = vec![
        (
            "no token",
            reqwest::Method::GET,
            "/api/processes".into(),
            None,
            None,
            None,
            401,
        ),
        (
            "viewer acting",
            reqwest::Method::POST,
            action("resume"),
            Some(&viewer),
            Some(pause.clone()),
            None,
            403,
        ),
        (
            "path id not a uuid",
            reqwest::Method::GET,
            "/api/processes/not-a-uuid".into(),
            Some(&op),
            None,
            None,
            400,
        ),
        (
            "query not parsing",
            reqwest::Method::GET,
            "/api/processes?limit=abc".into(),
            Some(&op),
            None,
            None,
            400,
        ),
        (
            "audit query not parsing",
            reqwest::Method::GET,
            "/api/audit?limit=-x".into(),
            Some(&op),
            None,
            None,
            400,
        ),
        (
            "method not taken",
            reqwest::Method::PUT,
            "/api/processes".into(),
            Some(&op),
            None,
            None,
            405,
        ),
        (
            "unknown route",
            reqwest::Method::GET,
            "/api/nothing-here".into(),
            Some(&op),
            None,
            None,
            404,
        ),
        (
            "unknown action",
            reqwest::Method::POST,
            action("fly"),
            Some(&op),
            Some(pause.clone()),
            None,
            404,
        ),
        (
            "body not the request",
            reqwest::Method::POST,
            action("resume"),
            Some(&op),
            Some(json!({"reason": 1})),
            None,
            400,
        ),
        (
            "key reused with another body",
            reqwest::Method::POST,
            action("pause"),
            Some(&op),
            Some(json!({"reason": "other", "version": version})),
            Some("k-1"),
            422,
        ),
    ];
    for (what, method, path, token, body, key, want) in cases {
        let mut req = c.web.http.request(method, format!("{}{path}", c.web.base));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let content_type = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let text = r.text().await.unwrap();
        assert_eq!(status, want, "{what}: {text}");
        assert!(
            content_type.starts_with("application/json"),
            "{what}: {content_type} {text}"
        );
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: {e}: {text}"));
        let obj = v.as_object().unwrap_or_else(|| panic!("{what}: {text}"));
        assert!(
            obj.len() == 1 && obj["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{what}: {text}"
        );
    }
}

/// An action's audit entry commits with its effect or not at all: when the audit insert fails,
/// the action answers 500 and the process is as it was, and a key sent with it is released (the
/// same key then runs the action afresh). A 409 (stale version) also releases its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_whose_audit_entry_fails_changes_nothing_and_releases_its_key() {
    let c = Console::start().await;
    let op = c.user("olga", Role::Operator).await;
    let id = c.process("audit-fails").await;
    let version = c.process_view(&op, id).await["version"].as_i64().unwrap();
    let before = c.process_state(id).await;
    let pause = format!("/api/processes/{id}/actions/pause");
    sqlx::raw_sql(
        "CREATE FUNCTION public.refuse_pause_audit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.action = 'process.pause' THEN RAISE EXCEPTION 'audit store refuses'; END IF; \
         RETURN NEW; END $$; \
         CREATE TRIGGER refuse_pause_audit BEFORE INSERT ON outbox.console_audit \
         FOR EACH ROW EXECUTE FUNCTION public.refuse_pause_audit()",
    )
    .execute(&c.db.pool)
    .await
    .unwrap();
    let body = json!({"reason": "hold", "version": version});
    for key in [None, Some("audit-k")] {
        let (s, err, _) = c.post(&op, &pause, body.clone(), key).await;
        assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{key:?}: {err}");
        assert_eq!(
            c.process_state(id).await,
            before,
            "{key:?}: nothing changed"
        );
    }
    sqlx::raw_sql("DROP TRIGGER refuse_pause_audit ON outbox.console_audit")
        .execute(&c.db.pool)
        .await
        .unwrap();

    // A stale version with another key: 409, and that key is not kept either.
    let stale = json!({"reason": "hold", "version": version - 1});
    let (s, _, _) = c.post(&op, &pause, stale, Some("stale-k")).await;
    assert_eq!(s, StatusCode::CONFLICT);
    for key in ["audit-k", "stale-k"] {
        let keyed = json!({"reason": format!("hold ({key})"), "version": c.process_view(&op, id).await["version"]});
        let (s, done, replayed) = c.post(&op, &pause, keyed, Some(key)).await;
        if key == "audit-k" {
            assert_eq!((s, replayed), (StatusCode::OK, false), "{done}");
        } else {
            // Paused by the first: not allowed now. Answered afresh, not replayed from the 409.
            assert_eq!((s, replayed), (StatusCode::CONFLICT, false), "{done}");
        }
    }
    let after = c.process_state(id).await;
    assert_eq!((after.1, after.2), (true, version + 1), "paused once");
    assert_eq!(c.audit_count("olga", "process.pause", "succeeded").await, 1);
}

/// Issue 23, item 1: the provider charged, its answer timed out, and the charge waits in manual
/// review with an unknown outcome. One approver's "resolve as failed" would compensate the steps
/// before the charge and leave the customer charged with nothing to refund it. The console (and
/// below it the processes crate) says the remote may have acted, offers the safe action for a
/// key-honouring remote first (rerun with the same key), and refuses resolving as failed without
/// what was checked at the remote and a second approver. Taking the safe action settles the payment
/// on the one charge the provider made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_of_unknown_outcome_is_never_resolved_failed_by_one_person_and_its_safe_action_comes_first()
 {
    use payment_provider::api::ChargeStatus;
    let c = Console::start().await;
    let alice = c.user("alice", Role::Approver).await;
    let bob = c.user("bob", Role::Approver).await;
    let olga = c.user("olga", Role::Operator).await;
    let pay = Payments::start_with(&c.db, 2).await;
    let (_, payment) = pay.order_and_pay("doubt", "cust-9", 1, 700).await;
    let pid: Uuid = wait_until("the payment's process", Duration::from_secs(30), || async {
        sqlx::query_scalar(
            "SELECT id FROM outbox.processes WHERE kind = 'payment' AND business_key = $1",
        )
        .bind(&payment)
        .fetch_optional(&c.db.pool)
        .await
        .unwrap()
    })
    .await;
    wait_process(&c.db.pool, pid, "manual_review").await;
    let charges = pay.charges(&payment).await;
    assert_eq!(
        (charges.len(), charges[0].status),
        (1, ChargeStatus::Succeeded),
        "the provider charged"
    );
    let payment_status = || async {
        sqlx::query_scalar::<_, String>("SELECT status FROM demo.payments WHERE id = $1::uuid")
            .bind(&payment)
            .fetch_one(&c.db.pool)
            .await
            .unwrap()
    };

    // The API says the remote may have acted and puts the safe action first.
    let view = c.process_view(&alice, pid).await;
    let charge = view["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "charge" && s["role"] == "forward")
        .cloned()
        .unwrap();
    let seq = charge["seq"].as_i64().unwrap();
    assert_eq!(
        (&charge["status"], &charge["error_class"]),
        (&json!("manual_review"), &json!("unknown")),
        "{view}"
    );
    let doubts = view["unknown_outcomes"].as_array().unwrap();
    assert_eq!(doubts.len(), 1, "{view}");
    assert_eq!(
        (
            &doubts[0]["step"],
            &doubts[0]["remote"],
            &doubts[0]["remote_may_have_acted"],
            &doubts[0]["safe_action"]
        ),
        (
            &json!(seq),
            &json!("honours_key"),
            &json!(true),
            &json!("rerun_step")
        )
    );
    assert!(
        doubts[0]["warning"]
            .as_str()
            .unwrap()
            .contains("may have acted")
    );
    let offered = view["allowed_actions"].as_array().unwrap();
    assert_eq!(
        (
            &offered[0]["action"],
            &offered[0]["step"],
            &offered[0]["safe_for_unknown_outcome"]
        ),
        (&json!("rerun_step"), &json!(seq), &json!(true)),
        "the safe action first: {offered:?}"
    );
    let failed = offered
        .iter()
        .find(|a| a["action"] == "resolve_failed")
        .unwrap();
    assert_eq!(
        (&failed["needs_approval"], &failed["needs_remote_check"]),
        (&json!(true), &json!(true))
    );

    // So does the page: the warning, and the rerun's form before the resolutions.
    let cookie = login(&c, &alice).await;
    let page = c
        .web
        .web_get(&cookie, &format!("/processes/{pid}"))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(&format!("id=\"unknown-outcome-{seq}\""))
            && page.contains("The remote may have acted"),
        "{page}"
    );
    let at = |id: String| {
        page.find(&id)
            .unwrap_or_else(|| panic!("{id} missing: {page}"))
    };
    assert!(
        at(format!("id=\"form-rerun_step-{seq}\""))
            < at(format!("id=\"form-resolve_failed-{seq}\"")),
        "rerun (safe) comes before resolve as failed"
    );
    assert!(page.contains(&format!("id=\"checked-resolve_failed-{seq}\"")));

    // One approver's "resolve as failed": without what was checked at the remote, refused.
    let path = format!("/api/processes/{pid}/actions/resolve_failed");
    let before = c.process_state(pid).await;
    let err = c
        .post_expect(
            &alice,
            &path,
            json!({"reason": "timed out, so it failed", "version": view["version"], "step": seq}),
            None,
            StatusCode::BAD_REQUEST,
        )
        .await;
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .contains("remote may have acted"),
        "{err}"
    );
    // With it, only an approval request: nothing runs on one person's word.
    let body = c
        .post_expect(
            &alice,
            &path,
            json!({"reason": "timed out, so it failed", "version": view["version"], "step": seq,
                   "remote_check": {"checked": "nothing, the call timed out", "answer": "none"}}),
            None,
            StatusCode::ACCEPTED,
        )
        .await;
    let approval = body["approval"].as_str().unwrap().to_string();
    assert_eq!(c.process_state(pid).await, before, "nothing changed");
    // Nor by herself.
    let (s, _) = c.try_approve(&alice, &approval, "mine").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    // Below the console, the processes crate refuses it to one person too.
    let v = processes::admin::get(&c.db.pool, &Schema::default(), pid)
        .await
        .unwrap();
    let alone = processes::admin::act(
        &c.db.pool,
        &Schema::default(),
        pid,
        &processes::admin::Request {
            action: processes::admin::Action::ResolveFailed { seq: seq as i32 },
            reason: "timed out, so it failed".into(),
            seen_version: v.process.row_version,
            actor: "console:alice".into(),
            evidence: None,
            remote_check: Some(processes::admin::RemoteCheck {
                checked: "nothing".into(),
                answer: "none".into(),
            }),
            approved_by: None,
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(alone, processes::Error::NeedsSecondPerson { .. }),
        "{alone}"
    );
    assert_eq!(c.process_state(pid).await, before, "nothing changed");
    assert_eq!(payment_status().await, "pending");
    let charges = pay.charges(&payment).await;
    assert_eq!(
        (charges.len(), charges[0].status),
        (1, ChargeStatus::Succeeded),
        "charged, and the payment still open: not left charged on a failed payment"
    );

    // A second approver reads the warning, looks at the provider and rejects the request.
    c.post_expect(
        &bob,
        &format!("/api/approvals/{approval}/reject"),
        json!({"reason": "the provider shows the charge: not failed", "version": 1}),
        None,
        StatusCode::OK,
    )
    .await;
    assert_eq!(
        c.process_state(pid).await,
        before,
        "rejecting changes nothing"
    );

    // The safe action: an operator reruns the charge with the same key; the provider answers with
    // the charge it made, and the payment is captured on it.
    pay.admin.set_faults("").await.unwrap();
    c.post_expect(&olga,
            &format!("/api/processes/{pid}/actions/rerun_step"),
            json!({"reason": "same key: the provider answers with its charge", "version": view["version"], "step": seq}),
            None, StatusCode::OK).await;
    wait_process(&c.db.pool, pid, "succeeded").await;
    assert_eq!(payment_status().await, "succeeded");
    let charges = pay.charges(&payment).await;
    assert_eq!(
        (charges.len(), charges[0].status),
        (1, ChargeStatus::Succeeded),
        "charged once, and that charge is the payment's"
    );
    assert_eq!(
        c.audit_count("alice", "process.resolve_failed", "requested")
            .await,
        1
    );
    assert_eq!(
        c.audit_count("alice", "approval.approve", "denied").await,
        1
    );
    assert_eq!(c.audit_count("bob", "approval.reject", "rejected").await, 1);
}

/// Issue 23, item 2: strict security headers on every answer, cross-site POSTs refused (`/login`
/// included), notices only from the fixed set, idempotency lookups by POST, and axum's rejections
/// on the web side as the console's own error page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn security_headers_cross_site_posts_fixed_notices_and_web_error_pages() {
    let c = Console::start().await;
    let op = c.user("hera", Role::Operator).await;
    let cookie = login(&c, &op).await;
    let get = |path: &str, cookie: Option<&str>| {
        let mut r = c.web.http.get(format!("{}{path}", c.web.base));
        if let Some(k) = cookie {
            r = r.header("cookie", k);
        }
        r.send()
    };
    let bearer = c
        .web
        .http
        .get(format!("{}/api/whoami", c.web.base))
        .bearer_auth(&op)
        .send()
        .await
        .unwrap();
    for (what, r) in [
        ("login page", get("/login", None).await.unwrap()),
        ("overview", get("/", Some(&cookie)).await.unwrap()),
        ("API", bearer),
        ("API 404", get("/api/nowhere", None).await.unwrap()),
    ] {
        let h = r.headers();
        let v = |name: &str| {
            h.get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        let csp = v("content-security-policy");
        assert!(
            csp.contains("default-src 'none'")
                && csp.contains("frame-ancestors 'none'")
                && !csp.contains("script-src")
                && !csp.contains("unsafe-inline"),
            "{what}: {csp}"
        );
        assert_eq!(v("x-frame-options"), "DENY", "{what}");
        assert_eq!(v("x-content-type-options"), "nosniff", "{what}");
        assert_eq!(v("referrer-policy"), "same-origin", "{what}");
        assert_eq!(v("cache-control"), "no-store", "{what}");
        let body = r.text().await.unwrap();
        assert!(
            !body.contains("<script") && !body.contains("style="),
            "{what}: nothing the policy would block"
        );
    }
    let css = get("/style.css", None).await.unwrap();
    assert_eq!(css.status(), StatusCode::OK);
    assert!(
        css.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/css")
    );

    // Cross-site POSTs are refused before anything runs, /login included; a browser's same-origin
    // POST and a client without those headers (the CLI, an API client) pass.
    let login_with = |headers: Vec<(&'static str, String)>| {
        let mut r = c
            .web
            .http
            .post(format!("{}/login", c.web.base))
            .form(&[("token", op.as_str())]);
        for (k, v) in headers {
            r = r.header(k, v);
        }
        r.send()
    };
    let host = c.web.base.trim_start_matches("http://").to_string();
    for (headers, want) in [
        (
            vec![("origin", "http://evil.example".to_string())],
            StatusCode::FORBIDDEN,
        ),
        (vec![("origin", "null".to_string())], StatusCode::FORBIDDEN),
        (
            vec![("sec-fetch-site", "cross-site".to_string())],
            StatusCode::FORBIDDEN,
        ),
        (
            vec![("sec-fetch-site", "same-site".to_string())],
            StatusCode::FORBIDDEN,
        ),
        (
            vec![
                ("origin", format!("http://{host}")),
                ("sec-fetch-site", "cross-site".to_string()),
            ],
            StatusCode::FORBIDDEN,
        ),
        (
            vec![
                ("origin", format!("http://{host}")),
                ("sec-fetch-site", "same-origin".to_string()),
            ],
            StatusCode::SEE_OTHER,
        ),
        (vec![], StatusCode::SEE_OTHER),
    ] {
        let r = login_with(headers.clone()).await.unwrap();
        assert_eq!(r.status(), want, "{headers:?}");
        if want == StatusCode::FORBIDDEN {
            assert!(
                consoles::session_cookie(&r).is_none(),
                "no session for {headers:?}"
            );
            let page = r.text().await.unwrap();
            assert!(page.contains("id=\"error\""), "the console's page: {page}");
        }
    }
    let id = c.process("cross-site").await;
    let version = c.process_view(&op, id).await["version"].clone();
    let r = c
        .web
        .http
        .post(format!("{}/api/processes/{id}/actions/pause", c.web.base))
        .bearer_auth(&op)
        .header("origin", "https://evil.example")
        .json(&json!({"reason": "framed", "version": version}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert!(!c.process_state(id).await.1, "not paused");

    // Notices: only the fixed set; anything else in ?notice= shows nothing.
    let page = get("/?notice=Your+account+is+locked%2C+call+555", Some(&cookie))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!page.contains("call 555") && !page.contains("id=\"notice\""));
    let page = get(
        "/?notice=approval_requested&approval=<b>x</b>",
        Some(&cookie),
    )
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    assert!(page.contains("An approval request was created") && !page.contains("<b>x"));

    // Idempotency lookups: a POST (the key in the body), never a URL.
    let (s, body) = c.get(&op, "/api/idempotency?scope=s&key=k").await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED, "{body}");
    let (s, body, _) = c
        .post(
            &op,
            "/api/idempotency",
            json!({"scope": "s", "key": "k"}),
            None,
        )
        .await;
    assert_eq!((s, body), (StatusCode::OK, json!([])));
    let form = get("/idempotency", Some(&cookie))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        form.contains("method=\"post\" action=\"/idempotency\""),
        "{form}"
    );

    // axum's rejections on the web side: the console's error page, with the status kept.
    for (method, path, want) in [
        ("GET", "/processes/not-a-uuid", StatusCode::BAD_REQUEST),
        (
            "POST",
            "/ui/approvals/not-a-uuid/approve",
            StatusCode::BAD_REQUEST,
        ),
        (
            "GET",
            "/processes?older_than_seconds=soon",
            StatusCode::BAD_REQUEST,
        ),
        ("PUT", "/processes", StatusCode::METHOD_NOT_ALLOWED),
    ] {
        let r = c
            .web
            .http
            .request(method.parse().unwrap(), format!("{}{path}", c.web.base))
            .header("cookie", &cookie)
            .header("content-type", "application/x-www-form-urlencoded")
            .body("csrf=x")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), want, "{method} {path}");
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/html"),
            "{method} {path}"
        );
        let page = r.text().await.unwrap();
        assert!(page.contains("id=\"error\""), "{method} {path}: {page}");
    }
}

/// Issue 23, item 2: hostile text (NUL and other control characters, markup, very long strings,
/// arbitrary Unicode) in every kind of text input, from a role that may and one that may not:
/// never a 5xx, a control character is a 400 past the role check, and every 403 has its `denied`
/// audit entry (the audit entry of a refused caller is written whatever they sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_text_in_any_input_is_never_a_5xx_and_every_refusal_is_audited() {
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let c = Console::start().await;
    let viewer = c.user("vera", Role::Viewer).await;
    let op = c.user("oscar", Role::Operator).await;
    let viewer_cookie = login(&c, &viewer).await;
    let viewer_csrf = {
        let page = c
            .web
            .web_get(&viewer_cookie, "/")
            .await
            .text()
            .await
            .unwrap();
        csrf_of(&page)
    };
    let pid = c.process("hostile").await;
    let version = c.process_view(&op, pid).await["version"].clone();
    let nobody = Uuid::new_v4();
    let hostile = prop_oneof![
        any::<String>(),
        "[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}]{1,3}[a-z ]{0,8}",
        "[a-z]{0,6}\\x00[a-z]{0,6}",
        Just("\0".to_string()),
        Just("<script>alert(1)</script>".to_string()),
        Just("'; DROP TABLE outbox.console_audit; --".to_string()),
        Just("%00%0a../../etc/passwd".to_string()),
        Just("\u{202e}\u{feff}\u{200b}".to_string()),
        Just("x".repeat(5000)),
        Just(String::new()),
    ];
    let mut runner = TestRunner::default();
    let (mut cases, mut refused, mut requests) = (0, 0, 0);
    let mut controls = 0;
    for _ in 0..48 {
        let text = hostile.new_tree(&mut runner).unwrap().current();
        let has_control = text.chars().any(char::is_control);
        controls += usize::from(has_control);
        let seg = console::web::url_encode(&text);
        let mut answers: Vec<(String, StatusCode)> = Vec::new();
        // Actions: the viewer is refused each (403, audited), the operator gets past the role check.
        for (token, who) in [(&viewer, "viewer"), (&op, "operator")] {
            for (path, body) in [
                (
                    format!("/api/processes/{nobody}/actions/pause"),
                    json!({"reason": text, "version": version}),
                ),
                (
                    format!("/api/processes/{nobody}/actions/rerun_step"),
                    json!({"reason": "r", "version": 1, "evidence": text,
                           "remote_check": {"checked": text, "answer": text}}),
                ),
                (
                    format!("/api/dead-letters/{seg}/actions/replay"),
                    json!({"reason": text, "items": [{"message_id": text, "version": text}]}),
                ),
                (
                    format!("/api/outbox/dead/{nobody}/actions/requeue"),
                    json!({"reason": text, "version": 1}),
                ),
                (
                    format!("/api/approvals/{nobody}/approve"),
                    json!({"reason": text, "version": 1}),
                ),
                (
                    "/api/audit/actions/purge".to_string(),
                    json!({"reason": text}),
                ),
                (
                    "/api/processes/actions/rerun_step".to_string(),
                    json!({"filter": {"q": text, "step": text, "error_class": text,
                                      "in_review_longer_than": text},
                           "step": text, "reason": text, "dry_run": true}),
                ),
            ] {
                let (s, b, _) = c.post(token, &path, body, None).await;
                answers.push((format!("{who} POST {path}: {b}"), s));
            }
        }
        // Reads and lookups, with the text in every filter.
        for path in [
            "/api/processes".to_string(),
            "/api/audit".to_string(),
            "/api/approvals".to_string(),
            "/api/dead-letters".to_string(),
            "/api/outbox/dead".to_string(),
        ] {
            let r = c
                .web
                .http
                .get(format!("{}{path}", c.web.base))
                .bearer_auth(&op)
                .query(&[
                    ("kind", &text),
                    ("status", &text),
                    ("actor", &text),
                    ("target", &text),
                    ("consumer", &text),
                    ("q", &text),
                    ("step", &text),
                    ("error_class", &text),
                    ("remote", &text),
                    ("paused", &text),
                    ("in_review_longer_than", &text),
                    ("after", &text),
                ])
                .send()
                .await
                .unwrap();
            answers.push((format!("GET {path}"), r.status()));
        }
        let (s, b, _) = c
            .post(
                &op,
                "/api/idempotency",
                json!({"scope": text, "key": text}),
                None,
            )
            .await;
        answers.push((format!("idempotency: {b}"), s));
        // The web side: pages with the text in their filters, a form the viewer may not send, a
        // login with it as the token.
        for path in ["/audit", "/processes", "/dead-letters", "/messages", "/"] {
            let r = c
                .web
                .http
                .get(format!("{}{path}", c.web.base))
                .header("cookie", &viewer_cookie)
                .query(&[
                    ("actor", &text),
                    ("kind", &text),
                    ("consumer", &text),
                    ("notice", &text),
                    ("q", &text),
                    ("aggregate_id", &text),
                ])
                .send()
                .await
                .unwrap();
            answers.push((format!("web GET {path}"), r.status()));
        }
        let r = c
            .web
            .web_post(
                &viewer_cookie,
                &format!("/ui/processes/{pid}/actions/pause"),
                &[
                    ("csrf", viewer_csrf.as_str()),
                    ("version", &version.to_string()),
                    ("reason", &text),
                ],
            )
            .await;
        answers.push(("web viewer pause".into(), r.status()));
        let r = c.web.login_with(&text).await;
        answers.push(("login".into(), r.status()));

        for (what, status) in &answers {
            assert!(!status.is_server_error(), "{what} with {text:?}: {status}");
            if has_control && status.is_success() {
                // Only the overview, which ignores an unknown notice code, may answer 200.
                assert_eq!(what, "web GET /", "with {text:?}: {status}");
            }
        }
        refused += answers
            .iter()
            .filter(|(_, s)| *s == StatusCode::FORBIDDEN)
            .count();
        requests += answers.len();
        cases += 1;
    }
    let denied: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.console_audit WHERE outcome = 'denied' AND actor_name IN ('vera', 'oscar')",
    )
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(
        denied as usize, refused,
        "every 403 is audited, and only those"
    );
    // The viewer is refused every action (6 over the API, the web form): at least that many.
    assert!(refused >= cases * 7, "{refused} refusals in {cases} cases");
    assert!(controls > 0, "some cases had control characters");
    println!(
        "{cases} cases, {requests} requests, {refused} refusals audited, {controls} cases with control characters"
    );
    assert!(
        !c.process_state(pid).await.1,
        "never paused by hostile text"
    );
}

/// Issue 23, item 3: an approval is a card in business terms (what it does, the amount, the
/// process as it is now with a link); the same request twice answers with the first; the request
/// form is hidden while one waits; a request whose process moved on is closed as superseded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_are_cards_one_pending_per_target_and_superseded_when_the_process_moves_on() {
    let c = Console::start().await;
    let olga = c.user("olga", Role::Operator).await;
    let otto = c.user("otto", Role::Operator).await;
    let bob = c.user("bob", Role::Approver).await;
    let (id, shutdown, worker) = refund_in_review(&c, "refund-cards").await;
    let view = c.process_view(&olga, id).await;
    let path = format!("/api/processes/{id}/actions/run_compensation");
    let ask = |token: String, reason: &'static str, version: Value| {
        let path = path.clone();
        let c = &c;
        async move {
            c.post(
                &token,
                &path,
                json!({"reason": reason, "version": version}),
                None,
            )
            .await
        }
    };
    let (s, first, _) = ask(
        olga.clone(),
        "order refused: refund",
        view["version"].clone(),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{first}");
    assert_eq!(first["existing"], json!(false));
    // The same request again, by someone else: the first answers.
    let (s, again, _) = ask(otto.clone(), "refund please", view["version"].clone()).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{again}");
    assert_eq!(
        (&again["approval"], &again["existing"]),
        (&first["approval"], &json!(true))
    );
    assert_eq!(c.approvals().await, 1);

    // The approver's card: what it does, the amount, the process now, a link.
    let cookie = login(&c, &bob).await;
    let overview = c.web.web_get(&cookie, "/").await.text().await.unwrap();
    let approval = first["approval"].as_str().unwrap();
    let card = overview
        .split(&format!("id=\"approval-{approval}\""))
        .nth(1)
        .and_then(|rest| rest.split("</details></div>").next())
        .unwrap_or_else(|| panic!("no card: {overview}"));
    for part in [
        "Run the compensation",
        // Minor units shown in major ones (issue 40: it read "6396 EUR").
        "amount <b class=\"amount\">63.96 EUR</b> <small>(6396 minor units)</small>",
        &format!("href=\"/processes/{id}\""),
        "now <b>manual_review</b>",
        &format!("at version {}", view["version"]),
        "order refused: refund",
        &format!("approve-{approval}"),
    ] {
        assert!(card.contains(part), "{part} not in the card: {card}");
    }
    // The audit log's entry of the request changed nothing yet, and says so: the request and the
    // process as asked on, not a diff from one to the other (issue 40, bug 5).
    let audit = c.web.web_get(&cookie, "/audit").await.text().await.unwrap();
    let requested: Vec<&str> = audit
        .split("<tr class=\"audit-entry\">")
        .skip(1)
        .filter(|row| row.contains("process.run_compensation") && row.contains(">requested<"))
        .collect();
    assert_eq!(requested.len(), 2, "olga's and otto's: {audit}");
    for row in requested {
        assert!(
            row.contains("Nothing changed yet") && !row.contains("diff-changed"),
            "{row}"
        );
    }
    // The CLI's list says the same amount.
    let out = c.cli(&bob, &["approvals", "list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!(
            "process.run_compensation on process:{id}  by olga"
        )) && text
            .contains("    process order_sensitive refund-cards, now manual_review at version")
            && text.contains("    money: amount 63.96 EUR (6396 minor units)\n"),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The requester's process page: no second request form while it waits.
    let olga_cookie = login(&c, &olga).await;
    let page = c
        .web
        .web_get(&olga_cookie, &format!("/processes/{id}"))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        !page.contains("id=\"form-run_compensation-")
            && page.contains("id=\"pending-run_compensation-"),
        "{page}"
    );

    // The process moves on (paused): the request is closed as superseded, approving it is a 409,
    // and a new request is a new one.
    let (s, _, _) = c
        .post(
            &olga,
            &format!("/api/processes/{id}/actions/pause"),
            json!({"reason": "hold", "version": view["version"]}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, list) = c.get(&bob, "/api/approvals").await;
    assert_eq!(s, StatusCode::OK);
    let list: Vec<Value> = serde_json::from_str(&list).unwrap();
    assert_eq!(
        (list.len(), list[0]["status"].as_str()),
        (1, Some("superseded")),
        "{list:?}"
    );
    assert_eq!(list[0]["process"]["paused"], json!(true));
    let (s, _) = c.try_approve(&bob, approval, "ok").await;
    assert_eq!(s, StatusCode::CONFLICT);
    let now = c.process_view(&olga, id).await;
    let (s, fresh, _) = ask(olga.clone(), "still refund", now["version"].clone()).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{fresh}");
    assert_eq!(fresh["existing"], json!(false));
    assert_ne!(fresh["approval"], first["approval"]);
    assert_eq!(fx::effects(&c.db.pool, id).await, (1, 0), "no refund ran");
    shutdown.cancel();
    worker.await.unwrap().unwrap();
}

/// A process parked at a wait (issue 25): the API and the page say what it awaits, since when,
/// the deadline and what happens then; the operator's "query remote status" asks the remote at
/// once, through the console's audited action; resolving the wait as failed takes what was
/// checked at the remote and a second person, as any step whose outcome is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_wait_shows_what_it_awaits_and_an_operator_queries_the_remote_now() {
    use system_tests::wait_fixtures as wf;
    let c = Console::start().await;
    fx::setup(&c.db.pool).await.unwrap();
    wf::setup(&c.db.pool).await.unwrap();
    sqlx::query("INSERT INTO fake_remote.outcomes (charge, status) VALUES ('asked', 'succeeded')")
        .execute(&c.db.pool)
        .await
        .unwrap();
    let def = |kind: &str, remote| {
        wf::awaiting(
            kind,
            remote,
            Duration::from_secs(3600),
            &c.db.pool,
            &fx::Failpoint::default(),
        )
    };
    let mut ids = Vec::new();
    for (kind, remote, charge) in [
        ("await_query", processes::Remote::Queryable, "asked"),
        ("await_none", processes::Remote::Neither, "blind"),
    ] {
        let started = processes::start(
            &c.db.pool,
            &def(kind, remote),
            charge,
            &json!({"charge_id": charge}),
        )
        .await
        .unwrap();
        ids.push(started.id);
    }
    let (asked, blind) = (ids[0], ids[1]);
    let stop = CancellationToken::new();
    let worker = spawn_worker(
        &c.db.url,
        "w",
        wf::register(
            processes::Registry::new(),
            &c.db.pool,
            &fx::Failpoint::default(),
        ),
        stop.clone(),
    )
    .await;
    wait_process(&c.db.pool, asked, "waiting").await;
    wait_process(&c.db.pool, blind, "waiting").await;

    let op = c.user("olga", Role::Operator).await;
    let view = c.process_view(&op, asked).await;
    let step = view["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["execution"] == "wait")
        .unwrap()
        .clone();
    assert_eq!(step["wait_key"], json!("charge:asked"));
    assert!(step["wait_since"].is_string() && step["wait_until"].is_string());
    assert_eq!(step["parked"], json!(true), "by the processes crate's rule");
    // Both are listed as waiting; an unknown status is a 400 with only `error`.
    let (s, body) = c.get(&op, "/api/processes?status=waiting").await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let page: Value = serde_json::from_str(&body).unwrap();
    let listed = page["items"].as_array().unwrap();
    for id in [asked, blind] {
        assert!(
            listed.iter().any(|p| p["id"] == json!(id)),
            "{id} not listed: {body}"
        );
    }
    let (s, body) = c.get(&op, "/api/processes?status=parked").await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
    let err: Value = serde_json::from_str(&body).unwrap();
    assert!(
        err.get("error").is_some() && err.as_object().unwrap().len() == 1,
        "{err}"
    );
    let seq = step["seq"].clone();
    let names = offered(&view);
    assert_eq!(
        names.first().map(String::as_str),
        Some("query_remote_status"),
        "{names:?}"
    );
    assert!(names.iter().any(|n| n == "resolve_failed"), "{names:?}");

    let cookie = login(&c, &op).await;
    let page = c
        .web
        .web_get(&cookie, &format!("/processes/{asked}"))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(&format!("id=\"wait-{seq}\""))
            && page.contains("Waiting for event")
            && page.contains("charge:asked")
            && page.contains("the remote is queried"),
        "{page}"
    );
    let blind_page = c
        .web
        .web_get(&cookie, &format!("/processes/{blind}"))
        .await
        .text()
        .await
        .unwrap();
    assert!(blind_page.contains("cannot be queried"), "{blind_page}");
    assert!(!offered(&c.process_view(&op, blind).await).contains(&"query_remote_status".into()));

    // Query now: an operator action, audited; the worker asks the remote at once.
    c.post_expect(
        &op,
        &format!("/api/processes/{asked}/actions/query_remote_status"),
        json!({"reason": "the customer is on the phone", "version": view["version"], "step": seq}),
        None,
        StatusCode::OK,
    )
    .await;
    assert_eq!(
        c.audit_count("olga", "process.query_remote_status", "succeeded")
            .await,
        1
    );
    wait_process(&c.db.pool, asked, "succeeded").await;

    // Resolving the other wait as failed: what was checked, then a second person.
    let view = c.process_view(&op, blind).await;
    let seq = view["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["execution"] == "wait")
        .unwrap()["seq"]
        .clone();
    let path = format!("/api/processes/{blind}/actions/resolve_failed");
    let anna = c.user("anna", Role::Approver).await;
    c.post_expect(
        &anna,
        &path,
        json!({"reason": "no webhook came", "version": view["version"], "step": seq}),
        None,
        StatusCode::BAD_REQUEST,
    )
    .await;
    c.post_expect(&anna,
            &path,
            json!({"reason": "no webhook came", "version": view["version"], "step": seq,
                   "remote_check": {"checked": "provider dashboard, reference blind", "answer": "no charge"}}),
            None, StatusCode::ACCEPTED).await;
    assert_eq!(
        c.process_state(blind).await.0,
        "waiting",
        "nothing on one person's word"
    );
    stop.cancel();
    worker.await.unwrap().unwrap();
}
mod find;

/// The fields of the form `id` in `html` (`name="..." value="..."` of its inputs and buttons).
fn form_fields(html: &str, id: &str) -> Vec<(String, String)> {
    let form = html
        .split(&format!("id=\"{id}\""))
        .nth(1)
        .and_then(|rest| rest.split("</form>").next())
        .unwrap_or_else(|| panic!("no form {id}: {html}"));
    form.split("name=\"")
        .skip(1)
        .filter_map(|rest| {
            let (name, rest) = rest.split_once('"')?;
            let value = rest
                .split_once('>')
                .map(|(attrs, _)| attrs)
                .and_then(|attrs| attrs.split_once("value=\""))
                .and_then(|(_, v)| v.split_once('"'))
                .map(|(v, _)| v.replace("&quot;", "\"").replace("&amp;", "&"))
                .unwrap_or_default();
            Some((name.to_string(), value))
        })
        .collect()
}

/// Issue 40, bug 2: a dry run, the browser's Back, then the real action from the same form ran
/// into a 422 ("this Idempotency-Key was already used with a different request"): the dry run
/// spent the form's key. It spends none now, and its page has a button that runs the plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_spends_no_key_and_its_page_runs_the_plan() {
    let c = Console::start().await;
    let olga = c.user("olga", Role::Operator).await;
    let ids = c.dead_rows(2).await;
    let cookie = login(&c, &olga).await;
    let overview = c.web.web_get(&cookie, "/").await.text().await.unwrap();
    let csrf = csrf_of(&overview);
    let key = Uuid::new_v4().to_string();
    let item = format!("{}:{}", ids[0], c.version(ids[0]).await);
    let form = |button: &'static str| {
        vec![
            ("csrf", csrf.clone()),
            ("idempotency_key", key.clone()),
            ("item", item.clone()),
            ("reason", "the gateway is fixed".to_string()),
            (button, "1".to_string()),
        ]
    };
    let r = c
        .web
        .web_post(&cookie, "/ui/outbox/requeue", &form("dry_run"))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let plan = r.text().await.unwrap();
    assert!(plan.contains("requeue"), "{plan}");
    assert_eq!(c.state(ids[0]).await, "dead", "a dry run changes nothing");
    // Back, then the real action from the same form, with the same key.
    let r = c
        .web
        .web_post(&cookie, "/ui/outbox/requeue", &form("go"))
        .await;
    assert!(
        r.status().is_redirection() || r.status().is_success(),
        "{}: {}",
        r.status(),
        r.text().await.unwrap()
    );
    assert_eq!(c.state(ids[0]).await, "pending");

    // The second row: its dry run's page runs the plan with a key of its own.
    let item = format!("{}:{}", ids[1], c.version(ids[1]).await);
    let r = c
        .web
        .web_post(
            &cookie,
            "/ui/outbox/requeue",
            &[
                ("csrf", csrf.as_str()),
                ("idempotency_key", &Uuid::new_v4().to_string()),
                ("item", &item),
                ("reason", "the gateway is fixed"),
                ("dry_run", "1"),
            ],
        )
        .await;
    let plan = r.text().await.unwrap();
    let fields = form_fields(&plan, "run-plan");
    assert!(
        fields.contains(&("item".to_string(), item.clone())),
        "{fields:?}"
    );
    assert!(
        fields.contains(&("reason".to_string(), "the gateway is fixed".to_string())),
        "{fields:?}"
    );
    assert!(
        plan.contains("id=\"run-plan-reason\"") && plan.contains(" required"),
        "{plan}"
    );
    let r = c.web.web_post(&cookie, "/ui/outbox/requeue", &fields).await;
    assert!(
        r.status().is_redirection() || r.status().is_success(),
        "{}",
        r.status()
    );
    assert_eq!(c.state(ids[1]).await, "pending");
    // Each run once, audited as such.
    let done: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.console_audit WHERE action = 'outbox.requeue' AND outcome = 'succeeded'",
    )
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(done, 2);
}

/// Issue 40, item 6: a deep link survives the login (the login page carries the page asked for
/// and goes there after it), but never to another host; and the keyboard reaches the content and
/// the search first: a skip link is the first Tab stop, the search box has the focus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_link_survives_the_login_and_the_keyboard_skips_to_the_content() {
    let c = Console::start().await;
    let olga = c.user("olga", Role::Operator).await;
    let pid = c.process("deep-link").await;
    let deep = format!("/processes/{pid}?from=mail");
    let r = c
        .web
        .http
        .get(format!("{}{deep}", c.web.base))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_redirection(), "{}", r.status());
    let to_login = r.headers()["location"].to_str().unwrap().to_string();
    assert_eq!(
        to_login,
        format!("/login?next=%2Fprocesses%2F{pid}%3Ffrom%3Dmail")
    );
    let login_page = c
        .web
        .http
        .get(format!("{}{to_login}", c.web.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        login_page.contains(&format!("name=\"next\" value=\"{deep}\"")),
        "{login_page}"
    );
    let login = |next: String| {
        let c = &c;
        let olga = olga.clone();
        async move {
            let r = c
                .web
                .http
                .post(format!("{}/login", c.web.base))
                .form(&[("token", olga.as_str()), ("next", next.as_str())])
                .send()
                .await
                .unwrap();
            assert!(r.status().is_redirection(), "{}", r.status());
            r.headers()["location"].to_str().unwrap().to_string()
        }
    };
    assert_eq!(login(deep.clone()).await, deep);
    // Never another host: those go to the overview.
    for elsewhere in [
        "//evil.example/x",
        "https://evil.example/",
        "/\\evil.example",
        "javascript:alert(1)",
    ] {
        assert_eq!(login(elsewhere.to_string()).await, "/", "{elsewhere}");
    }

    let (_driver, b) = chromedriver().await;
    log_in(&b, &c.web.base, &olga).await;
    b.goto(&format!("{}/processes", c.web.base)).await.unwrap();
    let focused = b
        .execute("return document.activeElement.id;", vec![])
        .await
        .unwrap();
    assert_eq!(focused, json!("search"), "the search box has the focus");
    // On the overview (nothing focused), the first Tab.
    b.goto(&format!("{}/", c.web.base)).await.unwrap();
    b.active_element()
        .await
        .unwrap()
        .send_keys("\u{e004}")
        .await
        .unwrap();
    let first = b
        .execute("return document.activeElement.id;", vec![])
        .await
        .unwrap();
    assert_eq!(
        first,
        json!("skip"),
        "the first Tab stop skips to the content"
    );
    b.active_element()
        .await
        .unwrap()
        .send_keys("\u{e007}")
        .await
        .unwrap();
    let at = b
        .execute("return document.activeElement.id;", vec![])
        .await
        .unwrap();
    assert_eq!(
        at,
        json!("main"),
        "Enter on it moves the focus to the content"
    );
}

/// Issue 40, item 6: a form acting on a version that is no longer current answers a page that
/// says in words that nothing was done and why, with a link back to the item (it was a 409 page in
/// xmin numbers whose Back went to the overview).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_form_says_in_words_that_nothing_was_done_and_links_back_to_the_item() {
    let c = Console::start().await;
    let olga = c.user("olga", Role::Operator).await;
    let pid = c.process("stale-form").await;
    let cookie = login(&c, &olga).await;
    let page = c
        .web
        .web_get(&cookie, &format!("/processes/{pid}"))
        .await
        .text()
        .await
        .unwrap();
    let csrf = csrf_of(&page);
    let seen = c.process_view(&olga, pid).await["version"]
        .as_i64()
        .unwrap();
    // Someone else pauses it meanwhile.
    c.post_expect(
        &olga,
        &format!("/api/processes/{pid}/actions/pause"),
        json!({"reason": "hold", "version": seen}),
        None,
        StatusCode::OK,
    )
    .await;
    let r = c
        .web
        .web_post(
            &cookie,
            &format!("/ui/processes/{pid}/actions/pause"),
            &[
                ("csrf", csrf.as_str()),
                ("version", &seen.to_string()),
                ("reason", "hold it too"),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::CONFLICT);
    let page = r.text().await.unwrap();
    assert!(
        page.contains("id=\"conflict\"")
            && page.contains("Nothing was done: this changed since you opened the page"),
        "{page}"
    );
    assert!(
        page.contains(&format!("id=\"back\" href=\"/processes/{pid}\"")),
        "{page}"
    );
}

/// Issue 40, item 4: a dead row is an item with a page of its own (every field, each header, the
/// payload pretty and as stored, redacted; the requeue form; what operators did to it), the
/// overview links to it, and the approval card of a requeue names the rows it acts on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_row_has_a_page_and_the_approval_card_names_its_rows() {
    let c = Console::start().await;
    let olga = c.user("olga", Role::Operator).await;
    let bob = c.user("bob", Role::Approver).await;
    let ids = c.dead_rows(2).await;
    sqlx::query(
        "UPDATE outbox.messages SET headers = '{\"tenant\": \"acme\", \"x_region\": \"eu-1\"}' WHERE id = $1",
    )
    .bind(ids[0])
    .execute(&c.db.pool)
    .await
    .unwrap();
    let cookie = login(&c, &olga).await;
    let overview = c.web.web_get(&cookie, "/").await.text().await.unwrap();
    assert!(
        overview.contains(&format!("href=\"/outbox/dead/{}\"", ids[0])),
        "{overview}"
    );
    let r = c
        .web
        .web_get(&cookie, &format!("/outbox/dead/{}", ids[0]))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let page = r.text().await.unwrap();
    for part in [
        "payment.captured",
        "<code>tenant</code></td><td><code>acme</code>",
        "<code>x_region</code></td><td><code>eu-1</code>",
        "id=\"payload-pretty\"",
        "\n  &quot;amount&quot;: 12",
        "id=\"dead-row-requeue\"",
        &format!("value=\"{}:{}\"", ids[0], c.version(ids[0]).await),
        "nothing yet",
    ] {
        assert!(page.contains(part), "{part} in {page}");
    }
    for secret in [CARD, SECRET] {
        assert!(!page.contains(secret), "{secret} leaked: {page}");
    }

    // Two rows: a request whose card names both, linked; the row's page shows the request.
    let items: Vec<Value> = {
        let mut v = Vec::new();
        for id in &ids {
            v.push(json!({"id": id, "version": c.version(*id).await}));
        }
        v
    };
    c.post_expect(
        &olga,
        "/api/outbox/dead/actions/requeue",
        json!({"reason": "gateway fixed", "items": items}),
        None,
        StatusCode::ACCEPTED,
    )
    .await;
    let bob_cookie = login(&c, &bob).await;
    let overview = c.web.web_get(&bob_cookie, "/").await.text().await.unwrap();
    for id in &ids {
        assert!(
            overview.contains(&format!(
                "class=\"selected-row\" href=\"/outbox/dead/{id}\""
            )),
            "{overview}"
        );
    }
    let page = c
        .web
        .web_get(&cookie, &format!("/outbox/dead/{}", ids[1]))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("id=\"dead-row-history\"") && page.contains(">requested<"),
        "{page}"
    );
    // A row that is not dead answers 404 with the console's page.
    let r = c
        .web
        .web_get(&cookie, &format!("/outbox/dead/{}", Uuid::new_v4()))
        .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
}

/// Issue 40, item 8: a console served over HTTPS (`CONSOLE_COOKIE_SECURE=true`) sets its session
/// cookie as `__Host-console_session` with `Secure`, and never reads the plain name, which a
/// response over plain HTTP or a sibling host could have set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_console_sets_a_host_prefixed_secure_cookie_and_reads_only_that() {
    let c = Console::start_configured(&[], |c| c.cookie_secure = true).await;
    let olga = c.user("olga", Role::Operator).await;
    let r = c.web.login_with(&olga).await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER);
    let set = consoles::session_cookie(&r).expect("a session cookie");
    assert!(set.starts_with("__Host-console_session="), "{set}");
    for attr in ["; Secure", "Path=/", "HttpOnly", "SameSite=Strict"] {
        assert!(set.contains(attr), "{set} lacks {attr}");
    }
    assert!(!set.contains("Domain"), "{set}");
    let pair = set.split(';').next().unwrap().to_string();
    assert_eq!(
        c.web.web_get(&pair, "/").await.status(),
        StatusCode::OK,
        "the prefixed cookie is the session"
    );
    let plain = pair.replacen("__Host-console_session=", "console_session=", 1);
    assert_eq!(
        c.web.web_get(&plain, "/").await.status(),
        StatusCode::SEE_OTHER,
        "the plain name is not read"
    );
}
