//! The payment flow end to end: `POST /payments` (the API in this test process) starts a payment
//! process; `producer worker` child processes run it against the `payment-provider` simulator
//! (a child process too), on one fresh database. Success, decline, unknown outcomes with keys,
//! with a status query and with neither, a worker SIGKILLed after the provider charged, an order
//! cancelled before the capture was recorded, and 200 payments under seeded random faults and
//! worker kills. The provider's `/admin/charges` is the evidence of what was charged.

use payment_provider::api::{Charge, ChargeStatus};
use payment_provider::client::Client;
use processes::admin;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use shared::schema::Schema;
use std::collections::HashMap;
use std::time::Duration;
use system_tests::signals::sigkill;
use system_tests::{TestDb, demo_stack, wait_until};
use tokio::process::Child;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Generous: the machine is shared and loaded.
const WAIT: Duration = Duration::from_secs(90);
const ORDER: &str = r#"{"customer_id":"cust-1","currency":"EUR","items":[{"sku":"sku-1","quantity":2,"unit_price":250}]}"#;

/// The provider, the API, a way to start workers, on one database.
struct Flow {
    db: TestDb,
    provider: Child,
    provider_url: String,
    admin: Client,
    api: demo_stack::ApiClient,
    remote: &'static str,
    shutdown: CancellationToken,
}

impl Flow {
    /// `provider_env`: PROVIDER_* of the simulator; `remote`: PAYMENT_REMOTE of API and workers.
    /// A flow whose provider charges and then holds its answer back for `delay` (past the
    /// worker's call timeout: an unknown outcome), with each of `off` (`PROVIDER_IDEMPOTENCY`,
    /// `PROVIDER_STATUS_QUERY`) turned off.
    async fn timing_out(delay: &str, off: &[&str], remote: &'static str) -> Self {
        let mut env = vec![
            ("PROVIDER_FAULTS", "timeout_after_charge:100"),
            ("PROVIDER_TIMEOUT_DELAY", delay),
        ];
        env.extend(off.iter().map(|k| (*k, "off")));
        Self::start(&env, remote).await
    }

    async fn start(provider_env: &[(&str, &str)], remote: &'static str) -> Self {
        let db = TestDb::new().await;
        let (provider, provider_url) = demo_stack::spawn_provider(&db, provider_env).await;
        let shutdown = CancellationToken::new();
        let remote_kind = processes::Remote::parse(remote).expect("remote");
        let (api, key) = demo_stack::start_api(&db, remote_kind, shutdown.clone()).await;
        Self {
            admin: Client::new(&provider_url, Duration::from_secs(30)).unwrap(),
            api: demo_stack::ApiClient::new(api, key),
            db,
            provider,
            provider_url,
            remote,
            shutdown,
        }
    }

    /// A `producer worker` child process; `env` overrides the test defaults.
    fn worker(&self, name: &str, env: &[(&str, &str)]) -> Child {
        let mut cmd = demo_stack::worker_command(&self.db, &self.provider_url, self.remote, name);
        cmd.env("WORKER_CONCURRENCY", "8")
            .env("CHARGE_MAX_ATTEMPTS", "30")
            .env("CHARGE_RETRY_INITIAL_MS", "100")
            .env("CHARGE_RETRY_MAX_DELAY_MS", "800");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.spawn().expect("spawn producer worker")
    }

    async fn post(&self, path: &str, key: &str, body: &str) -> (u16, Value) {
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let r = self
            .api
            .post(path, key, body, &[("traceparent", traceparent)])
            .await;
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Places an order and requests its payment: (order id, payment id).
    async fn pay(&self, n: usize) -> (Uuid, Uuid) {
        let (status, order) = self.post("/orders", &format!("order-{n}"), ORDER).await;
        assert_eq!(status, 201, "{order}");
        let order_id = order["id"].as_str().unwrap().to_string();
        let body = json!({"order_id": order_id, "amount": 500, "currency": "EUR"}).to_string();
        let (status, payment) = self.post("/payments", &format!("pay-{n}"), &body).await;
        assert_eq!(status, 202, "{payment}");
        assert_eq!(payment["status"], json!("pending"));
        // A replayed request starts no second process.
        let (status, again) = self.post("/payments", &format!("pay-{n}"), &body).await;
        assert_eq!((status, &again["id"]), (202, &payment["id"]));
        (
            order_id.parse().unwrap(),
            payment["id"].as_str().unwrap().parse().unwrap(),
        )
    }

    async fn process_status(&self, payment: Uuid) -> String {
        sqlx::query_scalar(
            "SELECT status FROM outbox.processes WHERE kind = 'payment' AND business_key = $1",
        )
        .bind(payment.to_string())
        .fetch_one(&self.db.pool)
        .await
        .expect("the payment has a process")
    }

    async fn wait_status(&self, payment: Uuid, want: &str) {
        wait_until(
            &format!("payment {payment} process {want}"),
            WAIT,
            || async move {
                let s = self.process_status(payment).await;
                assert!(
                    s == want
                        || !matches!(
                            s.as_str(),
                            "succeeded" | "failed" | "compensated" | "manual_review"
                        ),
                    "payment {payment}: process {s}, expected {want}"
                );
                (s == want).then_some(())
            },
        )
        .await;
    }

    async fn charges(&self, payment: Uuid) -> Vec<Charge> {
        let reference = payment.to_string();
        self.admin
            .admin_charges()
            .await
            .expect("GET /admin/charges")
            .into_iter()
            .filter(|c| c.reference == reference)
            .collect()
    }

    async fn wait_charged(&self, payment: Uuid) {
        wait_until("the provider shows the charge", WAIT, || async move {
            (!self.charges(payment).await.is_empty()).then_some(())
        })
        .await;
    }

    async fn row(&self, payment: Uuid) -> (String, String) {
        sqlx::query_as(
            "SELECT p.status, o.status FROM demo.payments p JOIN demo.orders o ON o.id = p.order_id WHERE p.id = $1",
        )
        .bind(payment)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// Outbox events of `event_type` for `payment`: (payload, traceparent).
    async fn events(&self, payment: Uuid, event_type: &str) -> Vec<(Value, Option<String>)> {
        let rows: Vec<(sqlx::types::Json<Value>, sqlx::types::Json<Value>)> = sqlx::query_as(
            "SELECT payload, headers FROM outbox.messages WHERE aggregate_id = $1 AND event_type = $2",
        )
        .bind(payment.to_string())
        .bind(event_type)
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        rows.into_iter()
            .map(|(p, h)| (p.0, h.0["traceparent"].as_str().map(str::to_string)))
            .collect()
    }

    async fn step(&self, payment: Uuid, role: &str, name: &str) -> (String, i32, bool) {
        sqlx::query_as(
            "SELECT s.status, s.attempts, s.sensitive FROM outbox.process_steps s \
             JOIN outbox.processes p ON p.id = s.process_id \
             WHERE p.business_key = $1 AND s.role = $2 AND s.name = $3",
        )
        .bind(payment.to_string())
        .bind(role)
        .bind(name)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    /// The payment's process as operators see it.
    async fn process_view(&self, payment: Uuid) -> admin::ProcessView {
        let id: Uuid = sqlx::query_scalar("SELECT process_id FROM demo.payments WHERE id = $1")
            .bind(payment)
            .fetch_one(&self.db.pool)
            .await
            .unwrap();
        admin::get(&self.db.pool, &Schema::default(), id)
            .await
            .unwrap()
    }

    /// Performs the operator action `name` (it must be offered now) on the payment's process.
    async fn act(
        &self,
        payment: Uuid,
        name: &str,
        reason: &str,
        actor: &str,
        evidence: Option<String>,
    ) {
        let view = self.process_view(payment).await;
        let action = view
            .allowed
            .iter()
            .find(|a| a.name() == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} not offered: {:?}", view.allowed));
        admin::act(
            &self.db.pool,
            &Schema::default(),
            view.process.id,
            &admin::Request {
                action,
                reason: reason.into(),
                seen_version: view.process.row_version,
                actor: actor.into(),
                evidence,
                remote_check: None,
                // Both actions these tests take need a second person.
                approved_by: Some("second-approver@example.com".into()),
            },
        )
        .await
        .unwrap();
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        self.shutdown.cancel();
        let _ = self.provider.start_kill();
    }
}

/// Money taken: succeeded (or refunded) charges.
fn taken(charges: &[Charge]) -> usize {
    charges
        .iter()
        .filter(|c| c.status != ChargeStatus::Declined)
        .count()
}

#[tokio::test]
async fn a_payment_is_charged_once_and_captured_for_the_ledger() {
    let f = Flow::start(&[], "honours_key").await;
    let _w = f.worker("w1", &[]);
    let (_order, payment) = f.pay(1).await;
    f.wait_status(payment, "succeeded").await;
    assert_eq!(f.row(payment).await, ("succeeded".into(), "paid".into()));
    let charges = f.charges(payment).await;
    assert_eq!(charges.len(), 1, "{charges:?}");
    assert_eq!(
        (charges[0].status, charges[0].amount),
        (ChargeStatus::Succeeded, 500)
    );
    let captured = f.events(payment, "payment.captured").await;
    assert_eq!(captured.len(), 1);
    // What the ledger consumer reads.
    let p: demo::ledger::PaymentCaptured = serde_json::from_value(captured[0].0.clone()).unwrap();
    assert_eq!(
        p,
        demo::ledger::PaymentCaptured {
            account: "acme:EUR".into(),
            amount: 500
        }
    );
    assert_eq!(captured[0].0["charge_id"], json!(charges[0].id.to_string()));
    // The request's trace continues into the process's event.
    let requested = f.events(payment, "payment.requested").await;
    let trace = |tp: &Option<String>| shared::trace::trace_id(tp.as_deref()).map(str::to_string);
    assert_eq!(
        trace(&captured[0].1),
        Some("4bf92f3577b34da6a3ce929d0e0e4736".into())
    );
    assert_eq!(trace(&captured[0].1), trace(&requested[0].1));
    let charge_id: Option<String> =
        sqlx::query_scalar("SELECT charge_id FROM demo.payments WHERE id = $1")
            .bind(payment)
            .fetch_one(&f.db.pool)
            .await
            .unwrap();
    assert_eq!(charge_id, Some(charges[0].id.to_string()));
}

#[tokio::test]
async fn a_decline_fails_the_payment_and_releases_the_order() {
    let f = Flow::start(&[("PROVIDER_FAULTS", "decline:100")], "honours_key").await;
    let _w = f.worker("w1", &[]);
    let (_order, payment) = f.pay(1).await;
    f.wait_status(payment, "compensated").await;
    assert_eq!(f.row(payment).await, ("failed".into(), "placed".into()));
    let charges = f.charges(payment).await;
    assert_eq!(taken(&charges), 0, "{charges:?}");
    assert_eq!(f.step(payment, "forward", "charge").await.0, "failed");
    assert_eq!(
        f.step(payment, "compensation", "reserve_order").await.0,
        "succeeded"
    );
    assert_eq!(f.events(payment, "payment.failed").await.len(), 1);
    assert!(f.events(payment, "payment.captured").await.is_empty());
}

/// The provider charges and holds its answer past the worker's timeout until the fault is cleared.
async fn unknown_outcome_then_cleared(f: &Flow) -> Uuid {
    unknown_outcome_then(f, "").await
}

/// A payment whose charge attempt ended with an unknown outcome (the provider charged), after
/// which the provider's faults become `faults`.
async fn unknown_outcome_then(f: &Flow, faults: &str) -> Uuid {
    let (_order, payment) = f.pay(1).await;
    f.wait_charged(payment).await;
    wait_until("an attempt ended with an unknown outcome", WAIT, || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.process_steps WHERE name = 'charge' AND error_class = 'unknown' AND attempts >= 1",
        )
        .fetch_one(&f.db.pool)
        .await
        .unwrap();
        (n > 0).then_some(())
    })
    .await;
    f.admin.set_faults(faults).await.unwrap();
    payment
}

#[tokio::test]
async fn an_unknown_outcome_with_keys_is_retried_with_the_same_key_and_charged_once() {
    let f = Flow::timing_out("3s", &[], "honours_key").await;
    let _w = f.worker("w1", &[]);
    let payment = unknown_outcome_then_cleared(&f).await;
    f.wait_status(payment, "succeeded").await;
    assert_eq!(taken(&f.charges(payment).await), 1);
    assert!(f.step(payment, "forward", "charge").await.1 >= 2);
    assert_eq!(f.events(payment, "payment.captured").await.len(), 1);
}

#[tokio::test]
async fn an_unknown_outcome_without_keys_is_resolved_by_the_status_query_and_charged_once() {
    let f = Flow::timing_out("3s", &["PROVIDER_IDEMPOTENCY"], "queryable").await;
    let _w = f.worker("w1", &[]);
    let payment = unknown_outcome_then_cleared(&f).await;
    f.wait_status(payment, "succeeded").await;
    // Without keys a second call would have charged again: the query found the first charge.
    assert_eq!(taken(&f.charges(payment).await), 1);
    assert_eq!(f.row(payment).await, ("succeeded".into(), "paid".into()));
}

/// A payment whose charge timed out at a provider with neither keys nor a status query, once it
/// is in manual review: the flow, its worker and the payment.
async fn unknown_with_neither() -> (Flow, Child, Uuid) {
    let f = Flow::timing_out(
        "3s",
        &["PROVIDER_IDEMPOTENCY", "PROVIDER_STATUS_QUERY"],
        "none",
    )
    .await;
    let w = f.worker("w1", &[]);
    let (_order, payment) = f.pay(1).await;
    f.wait_status(payment, "manual_review").await;
    (f, w, payment)
}

#[tokio::test]
async fn an_unknown_outcome_with_neither_goes_to_manual_review() {
    let (f, _w, payment) = unknown_with_neither().await;
    assert_eq!(
        f.step(payment, "forward", "charge").await.0,
        "manual_review"
    );
    assert_eq!(
        taken(&f.charges(payment).await),
        1,
        "charged once, never called again"
    );
    assert_eq!(f.row(payment).await, ("pending".into(), "reserved".into()));
    // The operator's choices are visible.
    let view = f.process_view(payment).await;
    let names: Vec<&str> = view.allowed.iter().map(|a| a.name()).collect();
    assert!(
        names.contains(&"resolve_succeeded") && names.contains(&"resolve_failed"),
        "{names:?}"
    );
}

#[tokio::test]
async fn an_operator_resolves_an_unknown_charge_with_the_providers_charge_id_and_the_capture_is_recorded()
 {
    let (f, _w, payment) = unknown_with_neither().await;
    f.admin.set_faults("").await.unwrap();
    // The operator looks the payment up at the provider (by its reference, the payment id) ...
    let charges = f.charges(payment).await;
    assert_eq!(taken(&charges), 1, "{charges:?}");
    let charge_id = charges[0].id.to_string();
    // ... and resolves the charge as succeeded with the charge id as evidence.
    f.act(
        payment,
        "resolve_succeeded",
        "charge found at the provider by reference",
        "operator@example.com",
        Some(charge_id.clone()),
    )
    .await;
    // A worker continues with record_capture, which takes the charge id from the evidence.
    f.wait_status(payment, "succeeded").await;
    assert_eq!(f.row(payment).await, ("succeeded".into(), "paid".into()));
    assert_eq!(taken(&f.charges(payment).await), 1, "never charged again");
    let captured = f.events(payment, "payment.captured").await;
    assert_eq!(captured.len(), 1);
    assert_eq!(captured[0].0["charge_id"], json!(charge_id));
}

/// What could end the 200-payment run in a `compensated` payment whose money was taken: an
/// attempt charges but its answer comes too late (unknown), and every later attempt with the same
/// key gets a 503 before the provider looks at the key. The step waits for the provider without
/// spending attempts and stays in doubt; when its business deadline (`CHARGE_DEADLINE_SECS`)
/// passes, the outcome is still unknown: manual review, the order still reserved, never a failed
/// payment and a released order with the money kept.
#[tokio::test]
async fn an_unavailable_provider_after_an_unknown_charge_ends_at_the_deadline_in_review_not_in_a_failed_payment()
 {
    let f = Flow::timing_out("3s", &[], "honours_key").await;
    let _w = f.worker("w1", &[("CHARGE_DEADLINE_SECS", "8")]);
    // From then on every call is refused before the provider looks at its key.
    let payment = unknown_outcome_then(&f, "error_before_charge:100").await;
    f.wait_status(payment, "manual_review").await;
    let (status, attempts, _) = f.step(payment, "forward", "charge").await;
    assert_eq!(status, "manual_review");
    let class: Option<String> = sqlx::query_scalar(
        "SELECT s.error_class FROM outbox.process_steps s JOIN outbox.processes p ON p.id = s.process_id \
         WHERE p.business_key = $1 AND s.role = 'forward' AND s.name = 'charge'",
    )
    .bind(payment.to_string())
    .fetch_one(&f.db.pool)
    .await
    .unwrap();
    assert_eq!(
        class.as_deref(),
        Some("unknown"),
        "after {attempts} attempts"
    );
    assert_eq!(taken(&f.charges(payment).await), 1);
    assert_eq!(f.row(payment).await, ("pending".into(), "reserved".into()));
    assert!(f.events(payment, "payment.failed").await.is_empty());
}

#[tokio::test]
async fn a_worker_killed_after_the_provider_charged_is_replaced_and_the_payment_charged_once() {
    // The answer is held far longer than the worker waits for it: the worker is mid-call when the
    // charge exists, and is SIGKILLed there, before it could store the result.
    let f = Flow::timing_out("60s", &[], "honours_key").await;
    let mut a = f.worker("a", &[("PROVIDER_CALL_TIMEOUT_MS", "50000")]);
    let (_order, payment) = f.pay(1).await;
    f.wait_charged(payment).await;
    assert_eq!(f.step(payment, "forward", "charge").await.0, "running");
    sigkill(&a);
    let _ = a.wait().await;
    f.admin.set_faults("").await.unwrap();
    let _b = f.worker("b", &[]);
    f.wait_status(payment, "succeeded").await;
    assert_eq!(taken(&f.charges(payment).await), 1);
    assert_eq!(f.events(payment, "payment.captured").await.len(), 1);
}

#[tokio::test]
async fn an_order_cancelled_before_the_capture_needs_an_approved_refund() {
    let f = Flow::timing_out("3s", &[], "honours_key").await;
    let _w = f.worker("w1", &[]);
    let (order, payment) = f.pay(1).await;
    f.wait_charged(payment).await;
    // Support cancels the order while the charge's answer is still outstanding.
    demo_stack::cancel_order(&f.db, order).await;
    f.admin.set_faults("").await.unwrap();
    f.wait_status(payment, "manual_review").await;
    assert_eq!(f.step(payment, "forward", "charge").await.0, "succeeded");
    assert_eq!(
        f.step(payment, "forward", "record_capture").await.0,
        "failed"
    );
    let (status, _, sensitive) = f.step(payment, "compensation", "charge").await;
    assert_eq!(
        (status.as_str(), sensitive),
        ("manual_review", true),
        "the refund waits"
    );
    assert_eq!(f.row(payment).await, ("pending".into(), "cancelled".into()));
    let charges = f.charges(payment).await;
    assert_eq!(charges.len(), 1);
    assert_eq!(
        charges[0].status,
        ChargeStatus::Succeeded,
        "not refunded without approval"
    );
    assert!(f.events(payment, "payment.captured").await.is_empty());

    // An approver runs the refund.
    f.act(
        payment,
        "run_compensation",
        "order cancelled by support; refund approved",
        "approver@example.com",
        None,
    )
    .await;
    f.wait_status(payment, "compensated").await;
    let charges = f.charges(payment).await;
    assert_eq!(
        (charges.len(), charges[0].status),
        (1, ChargeStatus::Refunded)
    );
    assert_eq!(f.row(payment).await, ("failed".into(), "cancelled".into()));
    assert_eq!(f.events(payment, "payment.failed").await.len(), 1);
}

#[tokio::test]
async fn two_hundred_payments_under_random_faults_and_worker_kills_end_consistent() {
    let seed: u64 = std::env::var("PAYMENT_FLOW_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("PAYMENT_FLOW_SEED={seed}");
    let seed_s = seed.to_string();
    let f = Flow::start(
        &[
            (
                "PROVIDER_FAULTS",
                "error_before_charge:10,decline:10,reset_after_charge:5,timeout_after_charge:5",
            ),
            ("PROVIDER_SEED", &seed_s),
            ("PROVIDER_TIMEOUT_DELAY", "2s"),
        ],
        "honours_key",
    )
    .await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut workers: Vec<Child> = (0..3).map(|i| f.worker(&format!("w{i}"), &[])).collect();
    let mut payments = Vec::new();
    for n in 0..200 {
        payments.push(f.pay(n).await.1);
    }
    let finished = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox.processes WHERE kind = 'payment' \
             AND status IN ('succeeded', 'failed', 'compensated', 'manual_review')",
        )
        .fetch_one(&f.db.pool)
        .await
        .unwrap()
    };
    // Five kills, each once a further share of the payments has finished (never by the clock).
    for k in 0..5u32 {
        let target = 20 + i64::from(k) * 30;
        wait_until(&format!("{target} payments finished"), WAIT, || async {
            (finished().await >= target).then_some(())
        })
        .await;
        let i = rng.random_range(0..workers.len());
        sigkill(&workers[i]);
        let _ = workers[i].wait().await;
        println!("killed worker {i} after {} finished", finished().await);
        workers[i] = f.worker(&format!("w{i}-{k}"), &[]);
    }
    wait_until(
        "every payment finished",
        Duration::from_secs(150),
        || async { (finished().await == 200).then_some(()) },
    )
    .await;

    let charges = f.admin.admin_charges().await.unwrap();
    let mut by_ref: HashMap<String, Vec<Charge>> = HashMap::new();
    for c in charges {
        by_ref.entry(c.reference.clone()).or_default().push(c);
    }
    let mut tally: HashMap<String, usize> = HashMap::new();
    for p in &payments {
        let status = f.process_status(*p).await;
        let (payment, order) = f.row(*p).await;
        let taken = taken(by_ref.get(&p.to_string()).map(Vec::as_slice).unwrap_or(&[]));
        let captured = f.events(*p, "payment.captured").await.len();
        match status.as_str() {
            "succeeded" => {
                assert_eq!(
                    (payment.as_str(), order.as_str()),
                    ("succeeded", "paid"),
                    "{p}"
                );
                assert_eq!((taken, captured), (1, 1), "{p}: one charge, one capture");
            }
            "compensated" => {
                assert_eq!(
                    (payment.as_str(), order.as_str()),
                    ("failed", "placed"),
                    "{p}"
                );
                assert_eq!((taken, captured), (0, 0), "{p}: nothing taken");
                assert_eq!(f.events(*p, "payment.failed").await.len(), 1, "{p}");
            }
            "manual_review" => {
                assert_eq!(payment, "pending", "{p}");
                assert!(taken <= 1, "{p}: {taken} charges");
            }
            other => panic!("{p}: process ended {other}"),
        }
        *tally.entry(status).or_default() += 1;
    }
    println!("seed {seed}: {tally:?}");
    assert!(tally.get("succeeded").copied().unwrap_or(0) > 0);
    for w in &mut workers {
        sigkill(w);
    }
}
