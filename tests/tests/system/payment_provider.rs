//! The payment provider simulator as a child process (the built `payment-provider` binary) on a
//! fresh database: every endpoint, every fault mode at 100 % and how the typed client classifies
//! it, idempotency keys (replay, 422, concurrency, switched off), the lookup by reference switched
//! off, faults changed at run time, bad input, replayable fault draws.

use payment_provider::api::{Charge, ChargeStatus};
use payment_provider::client::{ChargeError, Client, QueryError, RefundError};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;
use system_tests::{TestDb, bin_path, free_addr, http_status, signals, wait_http_ok, wait_until};
use tokio::process::{Child, Command};

/// Generous: the machine is shared and loaded.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);
const STARTUP: Duration = Duration::from_secs(90);

/// A running simulator on its own database.
struct Provider {
    addr: SocketAddr,
    /// For the calls under test (timeouts short only where a test needs it).
    client: Client,
    /// For verification: always the generous timeout.
    admin: Client,
    child: Child,
    db: TestDb,
}

impl Provider {
    async fn start(env: &[(&str, &str)]) -> Self {
        Self::start_with_timeout(env, CLIENT_TIMEOUT).await
    }

    async fn start_with_timeout(env: &[(&str, &str)], client_timeout: Duration) -> Self {
        let db = TestDb::new_unmigrated().await;
        let addr = free_addr();
        let child = command(&db, addr, env)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn payment-provider");
        wait_http_ok("the provider answers /healthz", addr, "/healthz", STARTUP).await;
        let base = format!("http://{addr}");
        Self {
            addr,
            client: Client::new(&base, client_timeout).unwrap(),
            admin: Client::new(&base, CLIENT_TIMEOUT).unwrap(),
            child,
            db,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn charges(&self) -> Vec<Charge> {
        self.admin
            .admin_charges()
            .await
            .expect("GET /admin/charges")
    }

    /// `GET /admin/charges` as raw JSON.
    async fn raw_charges(&self) -> Vec<Value> {
        reqwest::get(self.url("/admin/charges"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The value of the metric `series` (name and labels) now.
    async fn counter(&self, series: &str) -> f64 {
        counter(&self.metrics().await, series)
    }

    /// `POST /charges` with `Idempotency-Key: key` and `body`, raw.
    async fn keyed_charge(&self, key: &str, body: &serde_json::Value) -> reqwest::Response {
        reqwest::Client::new()
            .post(self.url("/charges"))
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .unwrap()
    }
}

fn command(db: &TestDb, addr: SocketAddr, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(bin_path("payment-provider"));
    for var in [
        "PROVIDER_FAULTS",
        "PROVIDER_IDEMPOTENCY",
        "PROVIDER_STATUS_QUERY",
        "PROVIDER_SEED",
        "PROVIDER_TIMEOUT_DELAY",
        "PROVIDER_SLOW_DELAY",
        "PROVIDER_MODE",
        "PROVIDER_WEBHOOK_URL",
        "PROVIDER_WEBHOOK_SECRET",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("DATABASE_URL", &db.url)
        .env("PROVIDER_ADDR", addr.to_string())
        .env("RUST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// A 4xx whose JSON body is an object with only a non-empty string `error`.
async fn assert_only_error(response: reqwest::Response, status: u16, what: &str) {
    assert_eq!(response.status().as_u16(), status, "{what}");
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let object = body
        .as_object()
        .unwrap_or_else(|| panic!("{what}: body {body}"));
    assert_eq!(object.len(), 1, "{what}: only `error` expected, got {body}");
    assert!(
        object["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{what}: {body}"
    );
}

/// The value of a counter line like `name{label="value"} 3` in a Prometheus text page.
fn counter(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn every_endpoint() {
    let p = Provider::start(&[]).await;

    let charge = p.client.charge("order-1", 1999, "EUR", None).await.unwrap();
    assert_eq!(charge.status, ChargeStatus::Succeeded);
    assert_eq!(
        (charge.reference.as_str(), charge.amount),
        ("order-1", 1999)
    );
    assert_eq!(charge.currency, "EUR");

    assert_eq!(
        p.client.get_charge(charge.id).await.unwrap(),
        Some(charge.clone())
    );
    assert_eq!(
        p.client.get_charge(uuid::Uuid::new_v4()).await.unwrap(),
        None
    );
    assert_eq!(
        p.client.charges_by_reference("order-1").await.unwrap(),
        vec![charge.clone()]
    );
    assert_eq!(
        p.client.find_by_reference("order-1").await.unwrap(),
        Some(charge.clone())
    );
    assert_eq!(p.client.find_by_reference("order-2").await.unwrap(), None);

    // The admin list as raw JSON: id, reference, amount, status.
    let raw = p.raw_charges().await;
    assert_eq!(raw.len(), 1);
    assert_eq!(raw[0]["id"], json!(charge.id));
    assert_eq!(raw[0]["reference"], "order-1");
    assert_eq!(raw[0]["amount"], 1999);
    assert_eq!(raw[0]["status"], "succeeded");

    // Refund: whole, once; a second refund answers the first.
    let refund = p.client.refund(charge.id).await.unwrap();
    assert_eq!((refund.charge_id, refund.amount), (charge.id, 1999));
    let again = reqwest::Client::new()
        .post(p.url("/refunds"))
        .json(&json!({"charge_id": charge.id}))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status().as_u16(), 200);
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    assert_eq!(
        again.json::<payment_provider::api::Refund>().await.unwrap(),
        refund
    );
    let after = p.charges().await;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].status, ChargeStatus::Refunded);
    assert!(after[0].refunded_at.is_some());
    assert!(matches!(
        p.client.refund(uuid::Uuid::new_v4()).await,
        Err(RefundError::NotFound)
    ));

    // Operations endpoints.
    assert_eq!(http_status(p.addr, "/healthz").await, Some(200));
    assert_eq!(http_status(p.addr, "/readyz").await, Some(200));
    let metrics = p.metrics().await;
    assert_eq!(
        counter(&metrics, "provider_charges_total{outcome=\"succeeded\"}"),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        counter(&metrics, "provider_refunds_total{outcome=\"refunded\"}"),
        1.0
    );
    assert!(metrics.contains("provider_faults_injected_total{mode=\"decline\"}"));

    // Its own schema and history table; every table and column commented.
    let history: i64 = sqlx::query_scalar("SELECT count(*) FROM provider._migrations")
        .fetch_one(&p.db.pool)
        .await
        .unwrap();
    assert_eq!(history, 3);
    let uncommented: Vec<String> = sqlx::query_scalar(
        "SELECT c.table_name || '.' || c.column_name
           FROM information_schema.columns c
           JOIN pg_class t ON t.relname = c.table_name
           JOIN pg_namespace n ON n.oid = t.relnamespace AND n.nspname = c.table_schema
          WHERE c.table_schema = 'provider' AND c.table_name <> '_migrations'
            AND col_description(t.oid, c.ordinal_position::int) IS NULL",
    )
    .fetch_all(&p.db.pool)
    .await
    .unwrap();
    assert!(uncommented.is_empty(), "uncommented: {uncommented:?}");
    let outside: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('provider', 'pg_catalog', 'information_schema')",
    )
    .fetch_one(&p.db.pool)
    .await
    .unwrap();
    assert_eq!(outside, 0, "tables created outside the schema provider");
    // Closed here, on this runtime: TestDb's drop closes it from another runtime, which hangs
    // once this test's connections were used (their sockets belong to this runtime's reactor).
    p.db.pool.close().await;
}

#[tokio::test]
async fn decline_is_permanent_and_recorded() {
    let p = Provider::start(&[("PROVIDER_FAULTS", "decline:100")]).await;
    let err = p
        .client
        .charge("order-d", 500, "USD", Some("key-d"))
        .await
        .unwrap_err();
    let ChargeError::Declined { charge_id, .. } = &err else {
        panic!("expected Declined, got {err:?}");
    };
    assert!(!err.is_transient());
    let charges = p.charges().await;
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0].status, ChargeStatus::Declined);
    assert_eq!(*charge_id, Some(charges[0].id));

    // The same key gets the same answer and no second row.
    assert!(matches!(
        p.client.charge("order-d", 500, "USD", Some("key-d")).await,
        Err(ChargeError::Declined { .. })
    ));
    assert_eq!(p.charges().await.len(), 1);
    // A declined charge cannot be refunded.
    assert!(matches!(
        p.client.refund(charges[0].id).await,
        Err(RefundError::NotRefundable { .. })
    ));
    let metrics = p.metrics().await;
    assert_eq!(
        counter(&metrics, "provider_faults_injected_total{mode=\"decline\"}"),
        1.0
    );
    assert_eq!(
        counter(&metrics, "provider_charges_total{outcome=\"replayed\"}"),
        1.0
    );
}

#[tokio::test]
async fn error_before_charge_is_unavailable_and_charges_nothing() {
    let p = Provider::start(&[("PROVIDER_FAULTS", "error_before_charge:100")]).await;
    for _ in 0..3 {
        let err = p
            .client
            .charge("order-e", 500, "EUR", Some("key-e"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ChargeError::Unavailable { .. }),
            "expected Unavailable, got {err:?}"
        );
        assert!(err.is_transient());
    }
    assert!(p.charges().await.is_empty());
    assert_eq!(
        p.counter("provider_faults_injected_total{mode=\"error_before_charge\"}")
            .await,
        3.0
    );
    // Once the provider is healthy again, the same key charges once.
    p.admin.set_faults("").await.unwrap();
    let charge = p
        .client
        .charge("order-e", 500, "EUR", Some("key-e"))
        .await
        .unwrap();
    assert_eq!(p.charges().await, vec![charge]);
}

#[tokio::test]
async fn nobody_listening_is_unavailable() {
    let client = Client::new(&format!("http://{}", free_addr()), CLIENT_TIMEOUT).unwrap();
    let err = client.charge("order-x", 1, "EUR", None).await.unwrap_err();
    assert!(
        matches!(err, ChargeError::Unavailable { .. }),
        "expected Unavailable, got {err:?}"
    );
    assert!(matches!(
        client.find_by_reference("order-x").await,
        Err(QueryError::Unavailable { .. })
    ));
}

#[tokio::test]
async fn timeout_after_charge_charges_although_the_caller_gave_up() {
    // The answer comes an hour late; the caller waits 2 s.
    let p = Provider::start_with_timeout(
        &[
            ("PROVIDER_FAULTS", "timeout_after_charge:100"),
            ("PROVIDER_TIMEOUT_DELAY", "60m"),
        ],
        Duration::from_secs(2),
    )
    .await;
    let err = p
        .client
        .charge("order-t", 700, "EUR", Some("key-t"))
        .await
        .unwrap_err();
    let ChargeError::OutcomeUnknown { source, .. } = &err else {
        panic!("expected OutcomeUnknown, got {err:?}");
    };
    assert!(source.as_ref().is_some_and(|e| e.is_timeout()), "{err:?}");
    // The provider did charge: the caller must not treat the timeout as a failure.
    let charge = wait_until("the charge shows in /admin/charges", STARTUP, || {
        let p = &p;
        async move { p.charges().await.into_iter().next() }
    })
    .await;
    assert_eq!(
        (charge.reference.as_str(), charge.status),
        ("order-t", ChargeStatus::Succeeded)
    );
    assert_eq!(
        p.admin.find_by_reference("order-t").await.unwrap(),
        Some(charge.clone())
    );
    // A retry with the same key, once the provider answers in time, gets the same charge.
    p.admin.set_faults("").await.unwrap();
    let replayed = p
        .admin
        .charge("order-t", 700, "EUR", Some("key-t"))
        .await
        .unwrap();
    assert_eq!(replayed, charge);
    assert_eq!(p.charges().await.len(), 1);
    assert_eq!(
        p.counter("provider_faults_injected_total{mode=\"timeout_after_charge\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn reset_after_charge_drops_the_connection_after_charging() {
    let p = Provider::start(&[("PROVIDER_FAULTS", "reset_after_charge:100")]).await;
    let err = p
        .client
        .charge("order-r", 900, "EUR", None)
        .await
        .unwrap_err();
    let ChargeError::OutcomeUnknown { source, .. } = &err else {
        panic!("expected OutcomeUnknown, got {err:?}");
    };
    // Not a timeout: the connection really went away (30 s client timeout, answer at once).
    assert!(source.as_ref().is_some_and(|e| !e.is_timeout()), "{err:?}");
    let charges = wait_until("the charge shows in /admin/charges", STARTUP, || {
        let p = &p;
        async move { Some(p.charges().await).filter(|c| !c.is_empty()) }
    })
    .await;
    assert_eq!(charges.len(), 1);
    assert_eq!(
        (charges[0].reference.as_str(), charges[0].status),
        ("order-r", ChargeStatus::Succeeded)
    );
    // Without a key, the lookup by reference is how the caller learns the outcome.
    assert_eq!(
        p.client.find_by_reference("order-r").await.unwrap(),
        Some(charges[0].clone())
    );

    // At the socket level: no HTTP answer at all, the connection is reset or closed.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    let body = r#"{"amount":1,"currency":"EUR","reference":"raw"}"#;
    let request = format!(
        "POST /charges HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(CLIENT_TIMEOUT, s.read_to_end(&mut buf))
        .await
        .expect("the provider neither answered nor closed");
    match read {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        Ok(_) => assert!(
            buf.is_empty(),
            "got an answer: {:?}",
            String::from_utf8_lossy(&buf)
        ),
    }
    assert_eq!(p.charges().await.len(), 2);
}

#[tokio::test]
async fn slow_answers_late_but_charges() {
    let p = Provider::start(&[("PROVIDER_FAULTS", "slow:100")]).await;
    let charge = p.client.charge("order-s", 300, "EUR", None).await.unwrap();
    assert_eq!(charge.status, ChargeStatus::Succeeded);
    assert_eq!(
        p.counter("provider_faults_injected_total{mode=\"slow\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn idempotency_keys_replay_refuse_mismatches_and_serialise_races() {
    // A connection for each of the 20 racing requests: none waits for the pool.
    let p = Provider::start(&[("PROVIDER_DB_MAX_CONNECTIONS", "25")]).await;
    let first = p
        .client
        .charge("order-k", 1000, "EUR", Some("key-k"))
        .await
        .unwrap();
    let replay = p
        .keyed_charge(
            "key-k",
            &json!({"amount": 1000, "currency": "EUR", "reference": "order-k"}),
        )
        .await;
    assert_eq!(replay.status().as_u16(), 201);
    assert_eq!(
        replay
            .headers()
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    assert_eq!(replay.json::<Charge>().await.unwrap(), first);

    // Same key, another body: 422, nothing charged.
    let err = p
        .client
        .charge("order-k", 1001, "EUR", Some("key-k"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ChargeError::Invalid { status: 422, .. }),
        "{err:?}"
    );
    let mismatch = p
        .keyed_charge(
            "key-k",
            &json!({"amount": 1000, "currency": "EUR", "reference": "order-other"}),
        )
        .await;
    assert_only_error(mismatch, 422, "key reused for another reference").await;
    assert_eq!(p.charges().await, vec![first.clone()]);

    // 20 concurrent identical keyed requests: one charge, every caller gets it.
    let results = futures::future::join_all(
        (0..20).map(|_| p.client.charge("order-c", 42, "EUR", Some("key-c"))),
    )
    .await;
    let ids: std::collections::HashSet<_> = results
        .into_iter()
        .map(|r| r.expect("concurrent charge").id)
        .collect();
    assert_eq!(ids.len(), 1);
    let charges = p.charges().await;
    assert_eq!(charges.len(), 2);
    assert_eq!(
        charges.iter().filter(|c| c.reference == "order-c").count(),
        1
    );
    assert_eq!(
        p.counter("provider_charges_total{outcome=\"replayed\"}")
            .await,
        20.0
    );
}

#[tokio::test]
async fn idempotency_off_charges_every_time() {
    let p = Provider::start(&[("PROVIDER_IDEMPOTENCY", "off")]).await;
    let a = p
        .client
        .charge("order-o", 100, "EUR", Some("key-o"))
        .await
        .unwrap();
    let b = p
        .client
        .charge("order-o", 100, "EUR", Some("key-o"))
        .await
        .unwrap();
    assert_ne!(a.id, b.id);
    assert_eq!(p.charges().await.len(), 2);
    assert_eq!(
        p.client
            .charges_by_reference("order-o")
            .await
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        p.client.find_by_reference("order-o").await.unwrap(),
        Some(a)
    );
}

#[tokio::test]
async fn status_query_off_removes_the_lookup_by_reference() {
    let p = Provider::start(&[("PROVIDER_STATUS_QUERY", "off")]).await;
    let charge = p.client.charge("order-q", 100, "EUR", None).await.unwrap();
    assert!(matches!(
        p.client.find_by_reference("order-q").await,
        Err(QueryError::QueryUnsupported)
    ));
    let raw = reqwest::get(p.url("/charges?reference=order-q"))
        .await
        .unwrap();
    assert_only_error(raw, 501, "lookup by reference switched off").await;
    // The lookup by id stays.
    assert_eq!(p.client.get_charge(charge.id).await.unwrap(), Some(charge));
}

#[tokio::test]
async fn faults_change_at_run_time() {
    let p = Provider::start(&[]).await;
    assert_eq!(
        p.admin.set_faults("decline:100, slow:0").await.unwrap(),
        "decline:100"
    );
    let current: Value = reqwest::get(p.url("/admin/faults"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(current, json!({"faults": "decline:100"}));
    assert!(matches!(
        p.client.charge("order-f1", 100, "EUR", None).await,
        Err(ChargeError::Declined { .. })
    ));
    assert_eq!(
        p.admin.set_faults("error_before_charge:100").await.unwrap(),
        "error_before_charge:100"
    );
    assert!(matches!(
        p.client.charge("order-f2", 100, "EUR", None).await,
        Err(ChargeError::Unavailable { .. })
    ));

    // Invalid syntax: 400 with only `error`, and the faults stay as they were.
    let http = reqwest::Client::new();
    for bad in [
        json!({"faults": "decline"}),
        json!({"faults": "decline:101"}),
        json!({"faults": "explode:5"}),
        json!({"faults": "decline:5,decline:6"}),
        json!({"faults": "decline:-1"}),
        json!({"faults": 5}),
        json!({"fault": "decline:5"}),
        json!({}),
    ] {
        let r = http
            .post(p.url("/admin/faults"))
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_only_error(r, 400, &bad.to_string()).await;
    }
    let current: Value = reqwest::get(p.url("/admin/faults"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(current, json!({"faults": "error_before_charge:100"}));

    // An empty string clears them.
    assert_eq!(p.admin.set_faults("").await.unwrap(), "");
    let charge = p.client.charge("order-f3", 100, "EUR", None).await.unwrap();
    let charges = p.charges().await;
    assert_eq!(charges.len(), 2);
    assert_eq!(charges[0].status, ChargeStatus::Declined);
    assert_eq!(charges[1], charge);
}

#[tokio::test]
async fn bad_input_is_a_400_with_only_error() {
    let p = Provider::start(&[]).await;
    let http = reqwest::Client::new();
    let good = json!({"amount": 100, "currency": "EUR", "reference": "order-b"});
    let mut cases: Vec<(String, reqwest::RequestBuilder)> = Vec::new();
    for body in [
        json!({"amount": 0, "currency": "EUR", "reference": "r"}),
        json!({"amount": -5, "currency": "EUR", "reference": "r"}),
        json!({"amount": "100", "currency": "EUR", "reference": "r"}),
        json!({"amount": 1.5, "currency": "EUR", "reference": "r"}),
        json!({"amount": 100, "currency": "eur", "reference": "r"}),
        json!({"amount": 100, "currency": "EURO", "reference": "r"}),
        json!({"amount": 100, "currency": "EUR", "reference": ""}),
        json!({"amount": 100, "currency": "EUR", "reference": "x".repeat(201)}),
        json!({"amount": 100, "currency": "EUR", "reference": "a\nb"}),
        json!({"amount": 100, "currency": "EUR"}),
        json!({"amount": 100, "currency": "EUR", "reference": "r", "extra": 1}),
        json!([1, 2]),
    ] {
        cases.push((
            format!("POST /charges {body}"),
            http.post(p.url("/charges")).json(&body),
        ));
    }
    cases.push((
        "POST /charges not JSON".into(),
        http.post(p.url("/charges"))
            .header("content-type", "application/json")
            .body("{nope"),
    ));
    cases.push((
        "POST /charges without content type".into(),
        http.post(p.url("/charges")).body(good.to_string()),
    ));
    cases.push((
        "POST /charges with a 300-character key".into(),
        http.post(p.url("/charges"))
            .header("Idempotency-Key", "k".repeat(300))
            .json(&good),
    ));
    cases.push((
        "GET /charges/not-a-uuid".into(),
        http.get(p.url("/charges/not-a-uuid")),
    ));
    cases.push((
        "GET /charges without reference".into(),
        http.get(p.url("/charges")),
    ));
    cases.push((
        "POST /refunds bad id".into(),
        http.post(p.url("/refunds"))
            .json(&json!({"charge_id": "nope"})),
    ));
    for (what, request) in cases {
        assert_only_error(request.send().await.unwrap(), 400, &what).await;
    }
    assert_only_error(
        http.get(p.url("/nowhere")).send().await.unwrap(),
        404,
        "unknown route",
    )
    .await;
    assert!(p.charges().await.is_empty(), "bad input charged something");

    // The client classifies a refused request as Invalid (not retryable).
    let err = p.client.charge("r", 0, "EUR", None).await.unwrap_err();
    assert!(
        matches!(err, ChargeError::Invalid { status: 400, .. }),
        "{err:?}"
    );
    assert!(!err.is_transient());
    // A key that is no header value never leaves the client, and is not retryable either.
    let err = p
        .client
        .charge("r", 100, "EUR", Some("bad\nkey"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ChargeError::Invalid { status: 0, .. }),
        "{err:?}"
    );

    // A bad PROVIDER_FAULTS stops the binary at start with a message naming the problem.
    let out = command(&p.db, free_addr(), &[("PROVIDER_FAULTS", "explode:5")])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("explode"), "{stderr}");
}

#[tokio::test]
async fn a_seed_replays_the_same_faults() {
    async fn outcomes() -> Vec<bool> {
        let p =
            Provider::start(&[("PROVIDER_FAULTS", "decline:50"), ("PROVIDER_SEED", "42")]).await;
        let mut declined = Vec::new();
        for i in 0..30 {
            let r = p
                .client
                .charge(&format!("order-{i}"), 100, "EUR", None)
                .await;
            declined.push(matches!(r, Err(ChargeError::Declined { .. })));
        }
        declined
    }
    let a = outcomes().await;
    let b = outcomes().await;
    assert_eq!(a, b);
    assert!(a.contains(&true) && a.contains(&false), "{a:?}");
}

#[tokio::test]
async fn sigterm_sends_held_answers_and_exits_zero() {
    let mut p = Provider::start(&[
        ("PROVIDER_FAULTS", "timeout_after_charge:100"),
        ("PROVIDER_TIMEOUT_DELAY", "60m"),
    ])
    .await;
    // Patient enough to outlast any load on the machine: the answer must come from SIGTERM.
    let admin = Client::new(&p.url(""), Duration::from_secs(600)).unwrap();
    let held = tokio::spawn(async move { admin.charge("order-term", 100, "EUR", Some("k")).await });
    let charge = wait_until("the held charge is committed", STARTUP, || {
        let p = &p;
        async move { p.charges().await.into_iter().next() }
    })
    .await;
    signals::sigterm(&p.child);
    // The held answer goes out at shutdown instead of an hour later.
    let answered = held.await.unwrap().expect("the held answer");
    assert_eq!(answered, charge);
    let exit = tokio::time::timeout(STARTUP, p.child.wait())
        .await
        .expect("the provider exits after SIGTERM")
        .unwrap();
    assert_eq!(exit.code(), Some(0), "SIGTERM exits 0");
}
