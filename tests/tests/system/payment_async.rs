//! The payment process with the provider in async mode (issue 25, item 4): the charge answers
//! `202 pending`, the process waits for the signed webhook (received by the demo API at
//! `POST /webhooks/provider`, which wakes it in the inbox row's transaction), then records the
//! outcome; past `PAYMENT_CONFIRMATION_TIMEOUT` it asks the provider. Under every webhook fault
//! and the charge faults, no payment is charged twice and none is left undecided without an open
//! review case. The provider's `/admin/charges` is the evidence of what was charged.

use payment_provider::api::{Charge, ChargeStatus};
use payment_provider::client::Client;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;
use system_tests::{TestDb, demo_stack, wait_until};
use tokio::process::Child;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(120);
const SECRET: &str = "whsec_async_payment_test";
const ORDER: &str = r#"{"customer_id":"cust-1","currency":"EUR","items":[{"sku":"sku-1","quantity":2,"unit_price":250}]}"#;

struct Stack {
    db: TestDb,
    _provider: Child,
    provider_url: String,
    admin: Client,
    api: demo_stack::ApiClient,
    _shutdown: tokio_util::sync::DropGuard,
}

impl Stack {
    async fn start(faults: &str) -> Self {
        let db = TestDb::new().await;
        let shutdown = CancellationToken::new();
        let (api, key) = demo_stack::start_api_with(
            &db,
            processes::Remote::HonoursKey,
            Some(SECRET),
            shutdown.clone(),
        )
        .await;
        let webhook_url = format!("{api}/webhooks/provider");
        let (provider, provider_url) = demo_stack::spawn_provider(
            &db,
            &[
                ("PROVIDER_MODE", "async"),
                ("PROVIDER_WEBHOOK_URL", &webhook_url),
                ("PROVIDER_WEBHOOK_SECRET", SECRET),
                ("PROVIDER_CONFIRM_DELAY", "300ms"),
                ("PROVIDER_WEBHOOK_BACKOFF", "100ms"),
                ("PROVIDER_WEBHOOK_DELAY", "3s"),
                ("PROVIDER_FAULTS", faults),
                ("PROVIDER_SEED", "25"),
                ("PROVIDER_TIMEOUT_DELAY", "1500ms"),
            ],
        )
        .await;
        Self {
            admin: Client::new(&provider_url, Duration::from_secs(30)).unwrap(),
            api: demo_stack::ApiClient::new(api, key),
            db,
            _provider: provider,
            provider_url,
            _shutdown: shutdown.drop_guard(),
        }
    }

    fn worker(&self, name: &str) -> Child {
        demo_stack::worker_command(&self.db, &self.provider_url, "honours_key", name)
            .env("PAYMENT_CONFIRMATION_TIMEOUT", "2s")
            .env("CHARGE_MAX_ATTEMPTS", "8")
            .env("CHARGE_RETRY_INITIAL_MS", "200")
            .env("CHARGE_RETRY_MAX_DELAY_MS", "1000")
            .spawn()
            .expect("spawn producer worker")
    }

    async fn post(&self, path: &str, key: &str, body: &str) -> (u16, Value) {
        let r = self.api.post(path, key, body, &[]).await;
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn pay(&self, n: usize) -> Uuid {
        let (status, order) = self.post("/orders", &format!("order-{n}"), ORDER).await;
        assert_eq!(status, 201, "{order}");
        let body = json!({"order_id": order["id"], "amount": 500, "currency": "EUR"}).to_string();
        let (status, payment) = self.post("/payments", &format!("pay-{n}"), &body).await;
        assert_eq!(status, 202, "{payment}");
        payment["id"].as_str().unwrap().parse().unwrap()
    }

    /// (process status, payment status) of every payment.
    async fn states(&self) -> HashMap<Uuid, (String, String)> {
        let rows: Vec<(Uuid, String, String)> = sqlx::query_as(
            "SELECT p.id, pr.status, p.status FROM demo.payments p
             JOIN outbox.processes pr ON pr.kind = 'payment' AND pr.business_key = p.id::text",
        )
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        rows.into_iter().map(|(id, a, b)| (id, (a, b))).collect()
    }

    async fn wait_settled(&self, n: usize) -> HashMap<Uuid, (String, String)> {
        wait_until("every payment decided or in review", WAIT, || async move {
            let s = self.states().await;
            (s.len() == n
                && s.values().all(|(p, _)| {
                    matches!(
                        p.as_str(),
                        "succeeded" | "failed" | "compensated" | "manual_review"
                    )
                }))
            .then_some(s)
        })
        .await
    }

    async fn charges(&self) -> HashMap<String, Vec<Charge>> {
        let mut by: HashMap<String, Vec<Charge>> = HashMap::new();
        for c in self
            .admin
            .admin_charges()
            .await
            .expect("GET /admin/charges")
        {
            by.entry(c.reference.clone()).or_default().push(c);
        }
        by
    }

    async fn reasons(&self, payment: Uuid) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT h.reason FROM outbox.process_history h JOIN outbox.processes p ON p.id = h.process_id
             WHERE p.business_key = $1 ORDER BY h.id",
        )
        .bind(payment.to_string())
        .fetch_all(&self.db.pool)
        .await
        .unwrap()
    }
}

/// Every payment decided consistently with the provider, or in review; nothing charged twice.
fn check(states: &HashMap<Uuid, (String, String)>, charges: &HashMap<String, Vec<Charge>>) {
    for (id, (process, payment)) in states {
        let cs = charges.get(&id.to_string()).cloned().unwrap_or_default();
        let taken: Vec<&Charge> = cs
            .iter()
            .filter(|c| c.status != ChargeStatus::Declined)
            .collect();
        assert!(taken.len() <= 1, "payment {id} charged twice: {cs:?}");
        match (process.as_str(), payment.as_str()) {
            ("succeeded", "succeeded") => assert!(
                taken.len() == 1 && taken[0].status == ChargeStatus::Succeeded,
                "payment {id} recorded as captured, provider: {cs:?}"
            ),
            ("succeeded" | "failed" | "compensated", "failed") => assert!(
                taken.iter().all(|c| c.status == ChargeStatus::Refunded),
                "payment {id} failed locally but money is taken: {cs:?}"
            ),
            ("manual_review", "pending") => {}
            other => panic!("payment {id}: unexpected {other:?}, provider: {cs:?}"),
        }
    }
}

#[tokio::test]
async fn an_async_payment_waits_for_its_webhook_and_is_recorded_once() {
    let s = Stack::start("").await;
    let _w = s.worker("w1");
    let mut ids = Vec::new();
    for n in 0..4 {
        ids.push(s.pay(n).await);
    }
    let states = s.wait_settled(4).await;
    let charges = s.charges().await;
    check(&states, &charges);
    for id in &ids {
        assert_eq!(states[id], ("succeeded".into(), "succeeded".into()));
        let reasons = s.reasons(*id).await;
        assert!(
            reasons
                .iter()
                .any(|r| r.contains("waits for event charge:")),
            "the charge answered pending, so the process waited: {reasons:?}"
        );
        assert!(
            reasons.iter().any(|r| r.contains("received")),
            "woken by the webhook, not by the deadline's query: {reasons:?}"
        );
    }
}

#[tokio::test]
async fn a_lost_webhook_is_replaced_by_the_query_at_the_confirmation_timeout() {
    let s = Stack::start("webhook_lost:100").await;
    let _w = s.worker("w1");
    let a = s.pay(0).await;
    let b = s.pay(1).await;
    let states = s.wait_settled(2).await;
    check(&states, &s.charges().await);
    for id in [a, b] {
        assert_eq!(states[&id], ("succeeded".into(), "succeeded".into()));
        let reasons = s.reasons(id).await;
        assert!(
            reasons.iter().any(|r| r.contains("status query found")),
            "{reasons:?}"
        );
    }
}

#[tokio::test]
async fn every_webhook_fault_with_the_charge_faults_ends_decided_or_in_review_never_charged_twice()
{
    let s = Stack::start(
        "webhook_lost:20,webhook_duplicate:30,webhook_reorder:20,webhook_delay:20,webhook_5xx_retry:20,timeout_after_charge:10,decline:30",
    )
    .await;
    let mut w1 = s.worker("w1");
    let _w2 = s.worker("w2");
    let n = 24;
    for i in 0..n {
        s.pay(i).await;
    }
    // One worker killed while processes wait; the other and a fresh one finish them.
    tokio::time::sleep(Duration::from_secs(2)).await;
    w1.start_kill().expect("SIGKILL");
    let _ = w1.wait().await;
    let _w3 = s.worker("w3");
    let states = s.wait_settled(n).await;
    let charges = s.charges().await;
    check(&states, &charges);
    let count = |p: &str, q: &str| states.values().filter(|(a, b)| a == p && b == q).count();
    eprintln!(
        "{n} payments: {} captured, {} failed, {} in review",
        count("succeeded", "succeeded"),
        states.values().filter(|(_, b)| b == "failed").count(),
        count("manual_review", "pending")
    );
    assert!(count("succeeded", "succeeded") > 0);
    let declined = charges
        .values()
        .flatten()
        .filter(|c| c.status == ChargeStatus::Declined)
        .count();
    // 30 % of at least 24 charge calls: all missing would be 0.7^24 (about 1 in 5,000). The
    // provider's draws follow the workers' interleaving, so the seed alone does not fix them.
    assert!(declined > 0, "the decline fault struck");
}
