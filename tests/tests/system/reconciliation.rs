//! Regular reconciliation with the payment provider (issue 25, item 5): each mismatch kind,
//! injected through the simulator's admin API (`POST /admin/charges`, `POST /admin/charges/{id}`),
//! becomes one open case with its evidence; a second run opens none again; a mismatch that is gone
//! closes its case; a run while another holds the lock compares nothing. No money moves: the
//! provider's charges are the same before and after.

use demo::reconciliation::{ReconcileConfig, run_once};
use payment_provider::api::Charge;
use payment_provider::client::Client;
use serde_json::{Value, json};
use std::time::Duration;
use system_tests::{TestDb, demo_stack};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const ORDER: &str = r#"{"customer_id":"cust-1","currency":"EUR","items":[{"sku":"sku-1","quantity":2,"unit_price":250}]}"#;

struct Stack {
    db: TestDb,
    _provider: tokio::process::Child,
    provider_url: String,
    admin: Client,
    api: String,
    key: String,
    http: reqwest::Client,
    _stop: tokio_util::sync::DropGuard,
}

impl Stack {
    async fn start() -> Self {
        let db = TestDb::new().await;
        let (provider, provider_url) = demo_stack::spawn_provider(&db, &[]).await;
        let stop = CancellationToken::new();
        let (api, key) =
            demo_stack::start_api(&db, processes::Remote::HonoursKey, stop.clone()).await;
        Self {
            admin: Client::new(&provider_url, Duration::from_secs(30)).unwrap(),
            http: reqwest::Client::new(),
            db,
            _provider: provider,
            provider_url,
            api,
            key,
            _stop: stop.drop_guard(),
        }
    }

    async fn post(&self, url: String, body: &Value, key: Option<&str>) -> Value {
        let mut r = self.http.post(url).json(body);
        if let Some(k) = key {
            r = r.bearer_auth(&self.key).header("Idempotency-Key", k);
        }
        let r = r.send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        r.json().await.unwrap()
    }

    /// A payment of 500 EUR whose local status becomes `status`, created `age` ago.
    async fn payment(&self, n: usize, status: &str, age: Duration) -> Uuid {
        let order: Value = serde_json::from_str(ORDER).unwrap();
        let order = self
            .post(
                format!("{}/orders", self.api),
                &order,
                Some(&format!("o-{n}")),
            )
            .await;
        let p = self
            .post(
                format!("{}/payments", self.api),
                &json!({"order_id": order["id"], "amount": 500, "currency": "EUR"}),
                Some(&format!("p-{n}")),
            )
            .await;
        let id: Uuid = p["id"].as_str().unwrap().parse().unwrap();
        sqlx::query(
            "UPDATE demo.payments SET status = $2, created_at = now() - make_interval(secs => $3) WHERE id = $1",
        )
        .bind(id)
        .bind(status)
        .bind(age.as_secs_f64())
        .execute(&self.db.pool)
        .await
        .unwrap();
        id
    }

    /// A charge recorded at the provider through its admin API.
    async fn charge(&self, payment: Uuid, amount: i64, currency: &str, status: &str) -> Charge {
        let v = self
            .post(
                format!("{}/admin/charges", self.provider_url),
                &json!({"reference": payment.to_string(), "amount": amount, "currency": currency, "status": status}),
                None,
            )
            .await;
        serde_json::from_value(v).unwrap()
    }

    /// Open cases: (payment, kind).
    async fn open(&self) -> Vec<(Uuid, String)> {
        sqlx::query_as(
            "SELECT payment_id, kind FROM demo.reconciliation_cases WHERE resolved_at IS NULL ORDER BY payment_id, kind",
        )
        .fetch_all(&self.db.pool)
        .await
        .unwrap()
    }
}

fn cfg() -> ReconcileConfig {
    ReconcileConfig {
        settle: Duration::ZERO,
        pending_threshold: Duration::from_secs(3600),
        ..ReconcileConfig::default()
    }
}

#[tokio::test]
async fn each_mismatch_kind_becomes_one_case_with_evidence_and_closes_when_gone() {
    let s = Stack::start().await;
    let fresh = Duration::from_secs(120);
    // charged_not_recorded: money taken, the payment failed locally.
    let charged = s.payment(1, "failed", fresh).await;
    s.charge(charged, 500, "EUR", "succeeded").await;
    // recorded_not_charged: succeeded locally, nothing at the provider; and only a declined charge.
    let absent = s.payment(2, "succeeded", fresh).await;
    let declined = s.payment(3, "succeeded", fresh).await;
    s.charge(declined, 500, "EUR", "declined").await;
    // amount_mismatch: the amount, and the currency (edited after the fact).
    let amount = s.payment(4, "succeeded", fresh).await;
    s.charge(amount, 700, "EUR", "succeeded").await;
    let currency = s.payment(5, "succeeded", fresh).await;
    let c = s.charge(currency, 500, "EUR", "succeeded").await;
    s.post(
        format!("{}/admin/charges/{}", s.provider_url, c.id),
        &json!({"currency": "USD"}),
        None,
    )
    .await;
    // pending_too_long: undecided for two hours.
    let stale = s.payment(6, "pending", Duration::from_secs(7200)).await;
    // In order: succeeded with its charge; pending and young.
    let fine = s.payment(7, "succeeded", fresh).await;
    s.charge(fine, 500, "EUR", "succeeded").await;
    let young = s.payment(8, "pending", fresh).await;

    let before = s.admin.admin_charges().await.unwrap();
    let r = run_once(&s.db.pool, &s.admin, &cfg()).await.unwrap();
    assert!(r.ran);
    assert_eq!(r.payments, 8);
    let mut want = vec![
        (charged, "charged_not_recorded".to_string()),
        (absent, "recorded_not_charged".to_string()),
        (declined, "recorded_not_charged".to_string()),
        (amount, "amount_mismatch".to_string()),
        (currency, "amount_mismatch".to_string()),
        (stale, "pending_too_long".to_string()),
    ];
    want.sort();
    assert_eq!(s.open().await, want);
    assert!(
        !s.open()
            .await
            .iter()
            .any(|(p, _)| *p == fine || *p == young)
    );
    let evidence: Value =
        sqlx::query_scalar("SELECT evidence FROM demo.reconciliation_cases WHERE payment_id = $1")
            .bind(amount)
            .fetch_one(&s.db.pool)
            .await
            .unwrap();
    assert_eq!(evidence["payment"]["amount"], json!(500));
    assert_eq!(evidence["provider_charges"][0]["amount"], json!(700));

    // A second run finds the same and opens nothing new.
    let r = run_once(&s.db.pool, &s.admin, &cfg()).await.unwrap();
    assert!(r.found.is_empty(), "{r:?}");
    assert_eq!(s.open().await, want);

    // The missing charge turns up (late): its case closes.
    s.charge(absent, 500, "EUR", "succeeded").await;
    let r = run_once(&s.db.pool, &s.admin, &cfg()).await.unwrap();
    assert_eq!(r.resolved.get("recorded_not_charged"), Some(&1), "{r:?}");
    assert!(!s.open().await.iter().any(|(p, _)| *p == absent));

    // It never moved money: the provider has what we injected, nothing more.
    let after = s.admin.admin_charges().await.unwrap();
    assert_eq!(after.len(), before.len() + 1);
}

#[tokio::test]
async fn one_run_at_a_time() {
    let s = Stack::start().await;
    let p = s.payment(1, "succeeded", Duration::from_secs(120)).await;
    let mut holder = s.db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(hashtextextended('demo.reconciliation', 0))")
        .execute(&mut *holder)
        .await
        .unwrap();
    let r = run_once(&s.db.pool, &s.admin, &cfg()).await.unwrap();
    assert!(!r.ran, "another instance holds the lock");
    assert!(s.open().await.is_empty());
    sqlx::query("SELECT pg_advisory_unlock(hashtextextended('demo.reconciliation', 0))")
        .execute(&mut *holder)
        .await
        .unwrap();
    drop(holder);
    let r = run_once(&s.db.pool, &s.admin, &cfg()).await.unwrap();
    assert!(r.ran);
    assert_eq!(
        s.open().await,
        vec![(p, "recorded_not_charged".to_string())]
    );
}

/// The worker runs reconciliation on its interval and exports what it found (issue 25, item 5's
/// metrics): a mismatch counted once and open while it lasts, a payment pending too long, the
/// last successful run; when the mismatch is gone the next run counts it resolved.
#[tokio::test]
async fn the_worker_reconciles_on_its_interval_and_exports_the_metrics() {
    use system_tests::fleet::metric;
    let s = Stack::start().await;
    let absent = s.payment(1, "succeeded", Duration::from_secs(120)).await;
    s.payment(2, "pending", Duration::from_secs(7200)).await;
    // The payments' processes stay where they are: this test is about the comparison only.
    sqlx::query("UPDATE outbox.processes SET paused = true")
        .execute(&s.db.pool)
        .await
        .unwrap();
    let addr = system_tests::free_addr();
    let _worker = demo_stack::worker_command(&s.db, &s.provider_url, "honours_key", "w1")
        .env("METRICS_ADDR", addr.to_string())
        .env("RECONCILE_INTERVAL", "200ms")
        .env("RECONCILE_SETTLE", "0s")
        .env("RECONCILE_PENDING_THRESHOLD", "1h")
        .spawn()
        .expect("spawn producer worker");
    let kind = [("kind", "recorded_not_charged")];
    system_tests::wait_until(
        "the mismatch is exported",
        Duration::from_secs(60),
        || async {
            let found = metric(addr, "reconciliation_mismatches_found_total", &kind).await;
            let open = metric(addr, "reconciliation_unresolved", &kind).await;
            let pending = metric(addr, "reconciliation_pending_too_long", &[]).await;
            let last = metric(addr, "reconciliation_last_success_timestamp_seconds", &[]).await;
            (found == Some(1.0) && open == Some(1.0) && pending == Some(1.0) && last > Some(0.0))
                .then_some(())
        },
    )
    .await;
    // Found once, however many runs see it again.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        metric(addr, "reconciliation_mismatches_found_total", &kind).await,
        Some(1.0)
    );
    // The charge shows up at the provider: the next run closes the case and counts it resolved.
    s.charge(absent, 500, "EUR", "succeeded").await;
    system_tests::wait_until(
        "the resolution is exported",
        Duration::from_secs(60),
        || async {
            let resolved = metric(addr, "reconciliation_mismatches_resolved_total", &kind).await;
            let open = metric(addr, "reconciliation_unresolved", &kind).await;
            (resolved == Some(1.0) && open == Some(0.0)).then_some(())
        },
    )
    .await;
    assert!(!s.open().await.iter().any(|(p, _)| *p == absent));
}
