//! The producer API against real PostgreSQL, over real HTTP (axum on 127.0.0.1:0, reqwest).

use chrono::Utc;
use demo::replay_marker::mark_replayed;
use demo::{AppState, FaultHook, InjectedFault, ManualClock, Settings, Stage};
use futures::future::join_all;
use idempotency::hash_key;
use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use system_tests::{TestDb, bin_path, wait_until};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const ORDER: &str = r#"{"customer_id":"cust-1","currency":"EUR","items":[{"sku":"sku-1","quantity":2,"unit_price":250}]}"#;

/// A running producer on a fresh database with two tenants.
struct Api {
    db: TestDb,
    base: String,
    client: reqwest::Client,
    shutdown: CancellationToken,
    /// Key of tenant `acme`.
    a: String,
    /// Key of tenant `globex`.
    b: String,
}

impl Drop for Api {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

struct Options {
    settings: Settings,
    clock: Option<ManualClock>,
    hook: Option<FaultHook>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            settings: Settings {
                purge_interval: None,
                ..Settings::default()
            },
            clock: None,
            hook: None,
        }
    }
}

/// A response, read whole.
#[derive(Debug)]
struct Resp {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }
    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

async fn start(opts: Options) -> Api {
    let db = TestDb::new().await;
    let a = demo::auth::create_api_key(&db.pool, "acme")
        .await
        .expect("create key");
    let b = demo::auth::create_api_key(&db.pool, "globex")
        .await
        .expect("create key");
    let mut state = AppState::new(db.pool.clone(), opts.settings);
    if let Some(clock) = &opts.clock {
        state = state.with_clock(clock.clock());
    }
    if let Some(hook) = opts.hook {
        state = state.with_fault_hook(hook);
    }
    let shutdown = CancellationToken::new();
    let server = demo::start(state, "127.0.0.1:0".parse().unwrap(), shutdown.clone())
        .await
        .expect("start producer");
    let base = format!("http://{}", server.local_addr());
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    Api {
        db,
        base,
        client,
        shutdown,
        a,
        b,
    }
}

impl Api {
    async fn send(&self, req: reqwest::RequestBuilder) -> Resp {
        let r = req.send().await.expect("HTTP request");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.text().await.expect("read body");
        Resp {
            status,
            headers,
            body,
        }
    }

    /// POST with a JSON body given as exact bytes.
    async fn post(
        &self,
        path: &str,
        api_key: Option<&str>,
        idem: Option<&str>,
        body: &str,
    ) -> Resp {
        let mut req = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(k) = api_key {
            req = req.bearer_auth(k);
        }
        if let Some(k) = idem {
            req = req.header(
                "idempotency-key",
                HeaderValue::from_bytes(k.as_bytes()).expect("header value"),
            );
        }
        self.send(req).await
    }

    async fn get(&self, path: &str, api_key: Option<&str>) -> Resp {
        let mut req = self.client.get(format!("{}{path}", self.base));
        if let Some(k) = api_key {
            req = req.bearer_auth(k);
        }
        self.send(req).await
    }

    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.pool)
            .await
            .expect(sql)
    }

    /// Outbox rows of `event_type`.
    async fn events(&self, event_type: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE event_type = $1")
            .bind(event_type)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Idempotency records in `status`.
    async fn keys_in(&self, status: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox.idempotency_keys WHERE status = $1")
            .bind(status)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Places an order for tenant `a` and returns its id.
    async fn order(&self, key: &str) -> Uuid {
        let r = self.post("/orders", Some(&self.a), Some(key), ORDER).await;
        assert_eq!(r.status, 201, "{}", r.body);
        r.json()["id"].as_str().unwrap().parse().unwrap()
    }
}

fn payment_body(order_id: Uuid, amount: Value) -> String {
    json!({"order_id": order_id, "amount": amount, "currency": "EUR"}).to_string()
}

/// A 4xx body holds only `error` (string) or `errors` ([{field, message, code}]) and no internals.
fn assert_error_shape(r: &Resp) {
    assert!((400..500).contains(&r.status), "not a 4xx: {r:?}");
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    let v = r.json();
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("body is not an object: {}", r.body));
    assert_eq!(obj.len(), 1, "body must hold exactly one field: {}", r.body);
    match obj.iter().next().unwrap() {
        (k, Value::String(_)) if k == "error" => {}
        (k, Value::Array(list)) if k == "errors" => {
            assert!(!list.is_empty(), "{}", r.body);
            for e in list {
                let e = e.as_object().expect("error entry is an object");
                let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
                keys.sort_unstable();
                assert_eq!(keys, ["code", "field", "message"], "{}", r.body);
                assert!(e.values().all(Value::is_string), "{}", r.body);
            }
        }
        _ => panic!("unexpected error body: {}", r.body),
    }
    for leak in [
        "sqlx",
        "postgres",
        "SQL",
        "panicked",
        ".rs:",
        "/work/",
        "constraint",
    ] {
        assert!(!r.body.contains(leak), "body leaks {leak:?}: {}", r.body);
    }
}

fn field_errors(r: &Resp) -> Vec<(String, String)> {
    r.json()["errors"]
        .as_array()
        .unwrap_or_else(|| panic!("no errors array: {}", r.body))
        .iter()
        .map(|e| {
            (
                e["field"].as_str().unwrap().to_owned(),
                e["code"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// `n` identical POSTs at once: one effect, one fresh response, the rest replays or 409s.
async fn concurrent_identical(payments: bool, n: usize) {
    let api = start(Options::default()).await;
    let (path, body, fresh_status) = if payments {
        let order_id = api.order("setup").await;
        ("/payments", payment_body(order_id, json!(500)), 202)
    } else {
        ("/orders", ORDER.to_owned(), 201)
    };
    let results =
        join_all((0..n).map(|_| api.post(path, Some(&api.a), Some("same-key"), &body))).await;

    let fresh: Vec<&Resp> = results
        .iter()
        .filter(|r| r.status == fresh_status && !r.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one fresh response: {results:?}");
    let fresh = fresh[0];
    let (mut replays, mut conflicts) = (0, 0);
    for r in &results {
        assert!(r.status < 500, "no 5xx: {r:?}");
        if std::ptr::eq(r, fresh) {
            continue;
        }
        match r.status {
            s if s == fresh_status && r.replayed() => {
                assert_eq!(r.body, mark_replayed(&fresh.body));
                assert_eq!(r.header("location"), fresh.header("location"));
                replays += 1;
            }
            409 => {
                assert_eq!(r.header("retry-after"), Some("1"));
                assert_error_shape(r);
                conflicts += 1;
            }
            _ => panic!("unexpected response: {r:?}"),
        }
    }
    assert_eq!(replays + conflicts, n - 1);
    eprintln!("{n} concurrent requests: 1 fresh, {replays} replays, {conflicts} conflicts");
    if payments {
        assert_eq!(api.count("SELECT count(*) FROM demo.payments").await, 1);
        assert_eq!(api.events("payment.requested").await, 1);
    } else {
        assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 1);
        assert_eq!(api.events("order.placed").await, 1);
    }
    assert_eq!(api.keys_in("processing").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_identical_concurrent_orders_make_one_order() {
    concurrent_identical(false, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_identical_concurrent_orders_make_one_order() {
    concurrent_identical(false, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_identical_concurrent_payments_make_one_payment() {
    concurrent_identical(true, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_identical_concurrent_payments_make_one_payment() {
    concurrent_identical(true, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_byte_identical_and_other_payloads_are_rejected() {
    let api = start(Options::default()).await;
    let first = api.post("/orders", Some(&api.a), Some("k1"), ORDER).await;
    assert_eq!(first.status, 201, "{}", first.body);
    assert!(first.header("idempotent-replayed").is_none());
    let created = first.json();
    assert_eq!(created["replayed"], json!(false));
    assert_eq!(created["total_amount"], json!(500));
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(
        first.header("location"),
        Some(format!("/orders/{id}").as_str())
    );

    let expected_replay = first
        .body
        .replace("\"replayed\":false", "\"replayed\":true");
    let second = api.post("/orders", Some(&api.a), Some("k1"), ORDER).await;
    assert_eq!(second.status, 201);
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(second.body, expected_replay);
    assert_eq!(second.header("location"), first.header("location"));
    assert_eq!(second.json()["replayed"], json!(true));

    // Key order, whitespace and digits-as-string do not change the request.
    let reordered = r#"{ "items" : [ { "unit_price" : "250", "quantity" : 2, "sku" : "sku-1" } ],
                          "currency" : "EUR", "customer_id" : "cust-1" }"#;
    let third = api
        .post("/orders", Some(&api.a), Some("k1"), reordered)
        .await;
    assert_eq!(
        (third.status, third.replayed()),
        (201, true),
        "{}",
        third.body
    );
    assert_eq!(third.body, expected_replay);

    // Another payload with the same key: 422, nothing changes, the original still replays.
    let other = ORDER.replace("\"quantity\":2", "\"quantity\":3");
    let mismatch = api.post("/orders", Some(&api.a), Some("k1"), &other).await;
    assert_eq!(mismatch.status, 422);
    assert_error_shape(&mismatch);
    assert!(mismatch.json()["error"].is_string());
    let again = api.post("/orders", Some(&api.a), Some("k1"), ORDER).await;
    assert_eq!(
        (again.status, again.body.as_str()),
        (201, expected_replay.as_str())
    );

    // The stored order is what the first response said.
    let got = api.get(&format!("/orders/{id}"), Some(&api.a)).await;
    assert_eq!(got.status, 200);
    let mut without_marker = created.clone();
    without_marker.as_object_mut().unwrap().remove("replayed");
    assert_eq!(got.json(), without_marker);

    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 1);
    assert_eq!(api.count("SELECT count(*) FROM demo.order_items").await, 1);
    assert_eq!(api.count("SELECT count(*) FROM outbox.messages").await, 1);
    assert_eq!(api.keys_in("completed").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitive_business_errors_are_stored_and_replayed() {
    let api = start(Options::default()).await;
    // A payment for an order that does not exist: 404, stored as failed, replayed.
    let missing = payment_body(Uuid::now_v7(), json!(100));
    let first = api
        .post("/payments", Some(&api.a), Some("pay-1"), &missing)
        .await;
    assert_eq!(first.status, 404, "{}", first.body);
    assert_error_shape(&first);
    let replay = api
        .post("/payments", Some(&api.a), Some("pay-1"), &missing)
        .await;
    assert_eq!((replay.status, replay.replayed()), (404, true));
    assert_eq!(replay.body, first.body);
    assert_error_shape(&replay);

    // Currency differs from the order's: 422 with a field error, stored and replayed.
    let order_id = api.order("o-1").await;
    let usd = json!({"order_id": order_id, "amount": 100, "currency": "USD"}).to_string();
    let first = api
        .post("/payments", Some(&api.a), Some("pay-2"), &usd)
        .await;
    assert_eq!(first.status, 422, "{}", first.body);
    assert_eq!(
        field_errors(&first),
        [("currency".to_owned(), "currency_mismatch".to_owned())]
    );
    let replay = api
        .post("/payments", Some(&api.a), Some("pay-2"), &usd)
        .await;
    assert_eq!(
        (replay.status, replay.replayed(), replay.body.as_str()),
        (422, true, first.body.as_str())
    );

    // Another tenant's order does not exist for this tenant.
    let foreign = payment_body(order_id, json!(100));
    let r = api
        .post("/payments", Some(&api.b), Some("pay-3"), &foreign)
        .await;
    assert_eq!(r.status, 404, "{}", r.body);

    assert_eq!(api.count("SELECT count(*) FROM demo.payments").await, 0);
    assert_eq!(api.events("payment.requested").await, 0);
    assert_eq!(api.keys_in("failed").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_scoped_by_tenant_and_operation() {
    let api = start(Options::default()).await;
    let a = api
        .post("/orders", Some(&api.a), Some("shared-key"), ORDER)
        .await;
    let b = api
        .post("/orders", Some(&api.b), Some("shared-key"), ORDER)
        .await;
    assert_eq!((a.status, a.replayed()), (201, false));
    assert_eq!((b.status, b.replayed()), (201, false));
    assert_ne!(a.json()["id"], b.json()["id"]);

    // The same key on /payments is another scope.
    let order_id: Uuid = a.json()["id"].as_str().unwrap().parse().unwrap();
    let p = api
        .post(
            "/payments",
            Some(&api.a),
            Some("shared-key"),
            &payment_body(order_id, json!(500)),
        )
        .await;
    assert_eq!((p.status, p.replayed()), (202, false), "{}", p.body);

    // Each tenant sees only its own order.
    let a_id = a.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        api.get(&format!("/orders/{a_id}"), Some(&api.a))
            .await
            .status,
        200
    );
    let hidden = api.get(&format!("/orders/{a_id}"), Some(&api.b)).await;
    assert_eq!(hidden.status, 404);
    assert_error_shape(&hidden);

    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 2);
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_key_rules() {
    let api = start(Options::default()).await;
    let too_long = "k".repeat(256);
    for (what, key) in [
        ("empty", Some("")),
        ("whitespace only", Some("    ")),
        ("256 characters", Some(too_long.as_str())),
        ("tab inside", Some("ab\tcd")),
        ("non-ASCII", Some("schlüssel")),
        ("missing", None),
    ] {
        let r = api.post("/orders", Some(&api.a), key, ORDER).await;
        assert_eq!(r.status, 400, "{what}: {}", r.body);
        assert_error_shape(&r);
    }
    let two = api
        .send(
            api.client
                .post(format!("{}/orders", api.base))
                .bearer_auth(&api.a)
                .header("content-type", "application/json")
                .header("idempotency-key", "one")
                .header("idempotency-key", "two")
                .body(ORDER),
        )
        .await;
    assert_eq!(two.status, 400);
    assert_error_shape(&two);
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        0
    );
    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 0);

    // SQL in a key is just bytes: stored (hashed) literally, replayed, nothing dropped.
    let sql_key = "'; DROP TABLE orders; --";
    let r = api
        .post("/orders", Some(&api.a), Some(sql_key), ORDER)
        .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let replay = api
        .post("/orders", Some(&api.a), Some(sql_key), ORDER)
        .await;
    assert!(replay.replayed());
    let stored: Vec<u8> = sqlx::query_scalar("SELECT key_hash FROM outbox.idempotency_keys")
        .fetch_one(&api.db.pool)
        .await
        .unwrap();
    assert_eq!(stored, hash_key(sql_key).0.to_vec());
    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 1);

    // 255 printable characters are fine.
    let longest = "k".repeat(255);
    let r = api
        .post("/orders", Some(&api.a), Some(&longest), ORDER)
        .await;
    assert_eq!(r.status, 201, "{}", r.body);
}

/// A hook that fails (or panics) the first time `stage` is reached.
fn fail_once(stage: Stage, panic: bool) -> FaultHook {
    let fired = Arc::new(AtomicBool::new(false));
    Arc::new(move |s, _op| {
        let fire = s == stage && !fired.swap(true, Ordering::SeqCst);
        Box::pin(async move {
            if fire {
                if panic {
                    panic!("injected panic at {stage:?}");
                }
                return Err(InjectedFault(format!("injected at {stage:?}")));
            }
            Ok(())
        })
    })
}

async fn failure_before_effect_releases_the_key(stage: Stage, panic: bool) {
    let api = start(Options {
        hook: Some(fail_once(stage, panic)),
        ..Options::default()
    })
    .await;
    let failed = api
        .post("/orders", Some(&api.a), Some("retry-me"), ORDER)
        .await;
    assert_eq!(failed.status, 500, "{}", failed.body);
    assert_eq!(failed.json(), json!({"error": "internal server error"}));
    // Released: no record, no effect.
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        0
    );
    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 0);
    assert_eq!(api.count("SELECT count(*) FROM outbox.messages").await, 0);

    let retry = api
        .post("/orders", Some(&api.a), Some("retry-me"), ORDER)
        .await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, false),
        "{}",
        retry.body
    );
    let replay = api
        .post("/orders", Some(&api.a), Some("retry-me"), ORDER)
        .await;
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 1);
    assert_eq!(api.count("SELECT count(*) FROM outbox.messages").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_after_reservation_releases_the_key() {
    failure_before_effect_releases_the_key(Stage::Reserved, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_after_reservation_releases_the_key() {
    failure_before_effect_releases_the_key(Stage::Reserved, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_before_commit_rolls_back_and_releases_the_key() {
    failure_before_effect_releases_the_key(Stage::BeforeCommit, false).await;
}

/// A hook that holds the first request reaching `Reserved` until `gate` is notified.
fn hold_first(entered: Arc<Notify>, gate: Arc<Notify>) -> FaultHook {
    let calls = Arc::new(AtomicUsize::new(0));
    Arc::new(move |stage, _op| {
        let hold = stage == Stage::Reserved && calls.fetch_add(1, Ordering::SeqCst) == 0;
        let (entered, gate) = (entered.clone(), gate.clone());
        Box::pin(async move {
            if hold {
                entered.notify_one();
                gate.notified().await;
            }
            Ok(())
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_conflict_lease_takeover_and_fencing() {
    let clock = ManualClock::new(Utc::now());
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let settings = Settings {
        lease: Duration::from_secs(30),
        purge_interval: None,
        ..Settings::default()
    };
    let api = Arc::new(
        start(Options {
            settings,
            clock: Some(clock.clone()),
            hook: Some(hold_first(entered.clone(), gate.clone())),
        })
        .await,
    );

    let slow = tokio::spawn({
        let api = api.clone();
        async move { api.post("/orders", Some(&api.a), Some("held"), ORDER).await }
    });
    entered.notified().await;

    // Still processing: 409 with Retry-After; another payload: 422; nothing stored for them.
    let busy = api.post("/orders", Some(&api.a), Some("held"), ORDER).await;
    assert_eq!(busy.status, 409, "{}", busy.body);
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_error_shape(&busy);
    let other = api
        .post(
            "/orders",
            Some(&api.a),
            Some("held"),
            &ORDER.replace("cust-1", "cust-2"),
        )
        .await;
    assert_eq!(other.status, 422);

    // The holder's lease expires (it hangs): a retry takes the record over and runs the effect.
    clock.advance(Duration::from_secs(31));
    let takeover = api.post("/orders", Some(&api.a), Some("held"), ORDER).await;
    assert_eq!(
        (takeover.status, takeover.replayed()),
        (201, false),
        "{}",
        takeover.body
    );

    // The old holder wakes up: its completion is fenced out, its effect rolled back.
    gate.notify_one();
    let late = slow.await.unwrap();
    assert_eq!(late.status, 409, "{}", late.body);
    assert_error_shape(&late);

    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 1);
    assert_eq!(api.count("SELECT count(*) FROM outbox.messages").await, 1);
    let replay = api.post("/orders", Some(&api.a), Some("held"), ORDER).await;
    assert_eq!(
        (replay.status, replay.body.clone()),
        (201, mark_replayed(&takeover.body))
    );

    let metrics = api.get("/metrics", None).await.body;
    assert!(metrics.contains(r#"outcome="taken_over""#), "{metrics}");
    assert!(metrics.contains(r#"outcome="conflict""#), "{metrics}");
    assert!(metrics.contains(r#"outcome="mismatch""#), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_keys_count_as_new() {
    let clock = ManualClock::new(Utc::now());
    let settings = Settings {
        idempotency_ttl: Duration::from_secs(3600),
        purge_interval: None,
        ..Settings::default()
    };
    let api = start(Options {
        settings,
        clock: Some(clock.clone()),
        ..Options::default()
    })
    .await;

    let first = api
        .post("/orders", Some(&api.a), Some("daily"), ORDER)
        .await;
    assert_eq!(first.status, 201);
    clock.advance(Duration::from_secs(1800));
    assert!(
        api.post("/orders", Some(&api.a), Some("daily"), ORDER)
            .await
            .replayed()
    );

    clock.advance(Duration::from_secs(1801));
    let anew = api
        .post("/orders", Some(&api.a), Some("daily"), ORDER)
        .await;
    assert_eq!(
        (anew.status, anew.replayed()),
        (201, false),
        "{}",
        anew.body
    );
    assert_ne!(anew.json()["id"], first.json()["id"]);
    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 2);

    // The renewed record is in force again: another payload is a mismatch...
    let other = ORDER.replace("cust-1", "cust-9");
    assert_eq!(
        api.post("/orders", Some(&api.a), Some("daily"), &other)
            .await
            .status,
        422
    );
    // ...until it expires too, then even another payload counts as new.
    clock.advance(Duration::from_secs(3601));
    let r = api
        .post("/orders", Some(&api.a), Some("daily"), &other)
        .await;
    assert_eq!((r.status, r.replayed()), (201, false), "{}", r.body);
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        1
    );

    let metrics = api.get("/metrics", None).await.body;
    assert!(
        metrics.contains(
            r#"api_idempotency_outcomes_total{operation="create_order",outcome="expired"} 2"#
        ),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_expired_final_records_in_batches_and_skips_processing_and_pending() {
    let clock = ManualClock::new(Utc::now());
    let ttl = Duration::from_secs(3600);
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let settings = Settings {
        idempotency_ttl: ttl,
        purge_interval: None,
        ..Settings::default()
    };
    let api = Arc::new(
        start(Options {
            settings,
            clock: Some(clock.clone()),
            hook: Some(hold_first(entered.clone(), gate.clone())),
        })
        .await,
    );
    let t0 = clock.now();

    // processing (held in flight), completed, failed, pending.
    let held = tokio::spawn({
        let api = api.clone();
        async move {
            api.post("/orders", Some(&api.a), Some("processing"), ORDER)
                .await
        }
    });
    entered.notified().await;
    let order_id = api.order("completed").await;
    let r = api
        .post(
            "/payments",
            Some(&api.a),
            Some("failed"),
            &payment_body(Uuid::now_v7(), json!(1)),
        )
        .await;
    assert_eq!(r.status, 404);
    let r = api
        .post(
            "/payments",
            Some(&api.a),
            Some("pending"),
            &payment_body(order_id, json!(1)),
        )
        .await;
    assert_eq!(r.status, 202);
    let payment_id: Uuid = r.json()["id"].as_str().unwrap().parse().unwrap();
    // An abandoned reservation: its holder died long ago and nobody retried.
    sqlx::query(
        "INSERT INTO outbox.idempotency_keys (scope, operation, key_hash, fingerprint, status, lease_token, \
             lease_expires_at, created_at, updated_at, expires_at) \
         VALUES ('acme', 'create_order', $1, $1, 'processing', $2, $3, $4, $4, $5)",
    )
    .bind(&hash_key("abandoned").0[..])
    .bind(Uuid::new_v4())
    .bind(t0 - chrono::TimeDelta::hours(3))
    .bind(t0 - chrono::TimeDelta::hours(4))
    .bind(t0 - chrono::TimeDelta::hours(3))
    .execute(&api.db.pool)
    .await
    .unwrap();

    let purge = |batch: u32, max_batches: u32| {
        let (pool, now) = (api.db.pool.clone(), clock.now());
        async move {
            idempotency::purge_expired(&pool, &Default::default(), now, ttl, batch, max_batches)
                .await
                .unwrap()
        }
    };
    // Nothing has expired yet except the abandoned reservation.
    assert_eq!(purge(1, 100).await, 1);
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        4
    );

    clock.advance(ttl + Duration::from_secs(1));
    assert_eq!(
        purge(1, 100).await,
        2,
        "completed and failed go, one per batch"
    );
    let left: Vec<String> =
        sqlx::query_scalar("SELECT status FROM outbox.idempotency_keys ORDER BY status")
            .fetch_all(&api.db.pool)
            .await
            .unwrap();
    assert_eq!(left, ["pending", "processing"]);

    // The downstream charge settles the payment: its record completes and can go.
    sqlx::query("UPDATE demo.payments SET status = 'succeeded' WHERE id = $1")
        .bind(payment_id)
        .execute(&api.db.pool)
        .await
        .unwrap();
    assert_eq!(purge(10, 10).await, 1);
    let left: Vec<String> = sqlx::query_scalar("SELECT status FROM outbox.idempotency_keys")
        .fetch_all(&api.db.pool)
        .await
        .unwrap();
    assert_eq!(left, ["processing"]);

    // Bounded: batch size times batches per run.
    for i in 0..5 {
        sqlx::query(
            "INSERT INTO outbox.idempotency_keys (scope, operation, key_hash, fingerprint, status, response_status, \
                 response_body, created_at, updated_at, expires_at) \
             VALUES ('acme', 'create_order', $1, $1, 'completed', 201, '{}', $2, $2, $3)",
        )
        .bind(&hash_key(&format!("old-{i}")).0[..])
        .bind(t0 - chrono::TimeDelta::hours(2))
        .bind(t0 - chrono::TimeDelta::hours(1))
        .execute(&api.db.pool)
        .await
        .unwrap();
    }
    assert_eq!(purge(2, 2).await, 4);
    assert_eq!(purge(2, 2).await, 1);

    // The held request still completes normally.
    gate.notify_one();
    let done = held.await.unwrap();
    assert_eq!(done.status, 201, "{}", done.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_purge_removes_expired_records() {
    let clock = ManualClock::new(Utc::now());
    let settings = Settings {
        idempotency_ttl: Duration::from_secs(60),
        purge_interval: Some(Duration::from_millis(50)),
        ..Settings::default()
    };
    let api = start(Options {
        settings,
        clock: Some(clock.clone()),
        ..Options::default()
    })
    .await;
    api.order("soon-gone").await;
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        1
    );
    clock.advance(Duration::from_secs(61));
    wait_until(
        "the purge task to delete the expired record",
        Duration::from_secs(10),
        || async {
            (api.count("SELECT count(*) FROM outbox.idempotency_keys")
                .await
                == 0)
                .then_some(())
        },
    )
    .await;
    let metrics = api.get("/metrics", None).await.body;
    assert!(
        metrics.contains("api_idempotency_purged_total 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amount_and_currency_validation_matrix() {
    let api = start(Options::default()).await;
    let order_id = api.order("for-payments").await;
    let with = |field: &str, value: Value| {
        let mut body = json!({"order_id": order_id, "amount": 100, "currency": "EUR"});
        body[field] = value;
        body.to_string()
    };
    let raw = |amount_literal: &str| {
        format!(r#"{{"order_id":"{order_id}","amount":{amount_literal},"currency":"EUR"}}"#)
    };
    let mut cases: Vec<(String, &str)> = vec![
        (with("amount", json!("100; DROP TABLE payments")), "amount"),
        (with("amount", json!(1.5)), "amount"),
        (with("amount", json!(-1)), "amount"),
        (with("amount", json!(0)), "amount"),
        (with("amount", json!("0")), "amount"),
        (with("amount", json!("1e3")), "amount"),
        (with("amount", json!("  5")), "amount"),
        (with("amount", json!("5 ")), "amount"),
        (with("amount", json!("-5")), "amount"),
        (with("amount", json!("")), "amount"),
        (with("amount", json!(null)), "amount"),
        (with("amount", json!(true)), "amount"),
        (with("amount", json!("9223372036854775808")), "amount"),
        (raw("9223372036854775808"), "amount"),
        (raw("100000000000000000000000000"), "amount"),
        (raw("1e3"), "amount"),
        (raw("1.0"), "amount"),
        (with("currency", json!("eur")), "currency"),
        (with("currency", json!("EURO")), "currency"),
        (with("currency", json!("EU")), "currency"),
        (with("currency", json!("E1R")), "currency"),
        (with("currency", json!("ÉUR")), "currency"),
        (with("currency", json!(978)), "currency"),
        (with("currency", json!("")), "currency"),
        (with("order_id", json!("not-a-uuid")), "order_id"),
        (
            with("order_id", json!(order_id.simple().to_string())),
            "order_id",
        ),
        (with("surprise", json!(1)), "surprise"),
        (
            json!({"amount": 100, "currency": "EUR"}).to_string(),
            "order_id",
        ),
    ];
    cases.push((json!([1, 2]).to_string(), "body"));
    for (i, (body, field)) in cases.iter().enumerate() {
        let r = api
            .post("/payments", Some(&api.a), Some(&format!("bad-{i}")), body)
            .await;
        assert_eq!(r.status, 422, "{body}: {}", r.body);
        assert_error_shape(&r);
        let fields = field_errors(&r);
        assert!(
            fields.iter().any(|(f, _)| f == field),
            "{body}: expected an error on {field}: {}",
            r.body
        );
    }
    // Validation errors happen before reservation: nothing was stored for them.
    assert_eq!(
        api.count(
            "SELECT count(*) FROM outbox.idempotency_keys WHERE operation = 'create_payment'"
        )
        .await,
        0
    );

    // Order bodies: positive quantities and prices, items present, checked totals.
    let order_cases = [
        (
            r#"{"customer_id":"c","currency":"EUR","items":[{"sku":"a","quantity":0,"unit_price":1}]}"#,
            "items[0].quantity",
            "out_of_range",
        ),
        (
            r#"{"customer_id":"c","currency":"EUR","items":[{"sku":"a","quantity":1,"unit_price":1.5}]}"#,
            "items[0].unit_price",
            "invalid_type",
        ),
        (
            r#"{"customer_id":"c","currency":"EUR","items":[]}"#,
            "items",
            "invalid_value",
        ),
        (
            r#"{"customer_id":"c","currency":"EUR","items":[{"sku":"a","quantity":1,"unit_price":1,"x":1}]}"#,
            "items[0].x",
            "unknown_field",
        ),
        (
            r#"{"customer_id":"  ","currency":"EUR","items":[{"sku":"a","quantity":1,"unit_price":1}]}"#,
            "customer_id",
            "invalid_value",
        ),
        (
            r#"{"currency":"EUR","items":[{"sku":"a","quantity":1,"unit_price":1}]}"#,
            "customer_id",
            "required",
        ),
        (
            r#"{"customer_id":"c","currency":"EUR","items":[{"sku":"a","quantity":9223372036854775807,"unit_price":2}]}"#,
            "items[0]",
            "overflow",
        ),
        (
            r#"{"customer_id":"c","currency":"EUR","items":[{"sku":"a","quantity":9223372036854775807,"unit_price":1},{"sku":"b","quantity":1,"unit_price":1}]}"#,
            "items",
            "overflow",
        ),
    ];
    for (i, (body, field, code)) in order_cases.iter().enumerate() {
        let r = api
            .post(
                "/orders",
                Some(&api.a),
                Some(&format!("bad-order-{i}")),
                body,
            )
            .await;
        assert_eq!(r.status, 422, "{body}: {}", r.body);
        assert_error_shape(&r);
        assert!(
            field_errors(&r).contains(&((*field).to_owned(), (*code).to_owned())),
            "{body}: {}",
            r.body
        );
    }

    // Unreadable bodies: 400 or 415, never stored.
    for (body, content_type, status) in [
        ("{not json", "application/json", 400),
        (
            r#"{"order_id":"x","amount":1,"amount":2,"currency":"EUR"}"#,
            "application/json",
            400,
        ),
        ("", "application/json", 400),
        (r#"{"amount":1}"#, "text/plain", 415),
    ] {
        let r = api
            .send(
                api.client
                    .post(format!("{}/payments", api.base))
                    .bearer_auth(&api.a)
                    .header("idempotency-key", "unreadable")
                    .header("content-type", content_type)
                    .body(body),
            )
            .await;
        assert_eq!(r.status, status, "{body}: {}", r.body);
        assert_error_shape(&r);
    }
    assert_eq!(
        api.count(
            "SELECT count(*) FROM outbox.idempotency_keys WHERE operation = 'create_payment'"
        )
        .await,
        0
    );

    // The accepted forms: a JSON integer or a string of digits.
    for (i, amount) in [json!(100), json!("100"), json!(i64::MAX)]
        .into_iter()
        .enumerate()
    {
        let r = api
            .post(
                "/payments",
                Some(&api.a),
                Some(&format!("good-{i}")),
                &payment_body(order_id, amount),
            )
            .await;
        assert_eq!(r.status, 202, "{}", r.body);
    }
    assert_eq!(api.count("SELECT count(*) FROM demo.payments").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_requests_get_401_and_store_nothing() {
    let api = start(Options::default()).await;
    let revoked = demo::auth::create_api_key(&api.db.pool, "acme")
        .await
        .unwrap();
    sqlx::query("UPDATE demo.api_keys SET revoked_at = now() WHERE key_hash = $1")
        .bind(&demo::auth::hash_api_key(&revoked)[..])
        .execute(&api.db.pool)
        .await
        .unwrap();
    let bogus = demo::auth::generate_api_key();
    for key in [None, Some(bogus.as_str()), Some(""), Some(revoked.as_str())] {
        let r = api.post("/orders", key, Some("k"), ORDER).await;
        assert_eq!(r.status, 401, "{key:?}: {}", r.body);
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        assert_error_shape(&r);
        let r = api.get(&format!("/orders/{}", Uuid::now_v7()), key).await;
        assert_eq!(r.status, 401);
        assert_error_shape(&r);
    }
    let basic = api
        .send(
            api.client
                .post(format!("{}/orders", api.base))
                .basic_auth("acme", Some(&api.a))
                .header("idempotency-key", "k")
                .header("content-type", "application/json")
                .body(ORDER),
        )
        .await;
    assert_eq!(basic.status, 401);
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        0
    );
    assert_eq!(api.count("SELECT count(*) FROM demo.orders").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413() {
    let settings = Settings {
        body_limit: 8 * 1024,
        purge_interval: None,
        ..Settings::default()
    };
    let api = start(Options {
        settings,
        ..Options::default()
    })
    .await;
    let huge = json!({"customer_id": "c".repeat(64 * 1024), "currency": "EUR",
        "items": [{"sku": "a", "quantity": 1, "unit_price": 1}]})
    .to_string();
    let r = api.post("/orders", Some(&api.a), Some("big"), &huge).await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert_error_shape(&r);
    assert_eq!(
        api.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await,
        0
    );
    // Under the limit is fine.
    assert_eq!(
        api.post("/orders", Some(&api.a), Some("small"), ORDER)
            .await
            .status,
        201
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_carry_trace_context_and_tenant_and_payments_are_asynchronous() {
    let api = start(Options::default()).await;
    let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = api
        .send(
            api.client
                .post(format!("{}/orders", api.base))
                .bearer_auth(&api.a)
                .header("idempotency-key", "traced")
                .header("content-type", "application/json")
                .header("traceparent", incoming)
                .body(ORDER),
        )
        .await;
    assert_eq!(r.status, 201);
    let order_id = r.json()["id"].as_str().unwrap().to_owned();
    let (aggregate_type, aggregate_id, payload, headers): (String, String, Value, Value) = sqlx::query_as(
        "SELECT aggregate_type, aggregate_id, payload, headers FROM outbox.messages WHERE event_type = 'order.placed'",
    )
    .fetch_one(&api.db.pool)
    .await
    .unwrap();
    assert_eq!(
        (aggregate_type.as_str(), aggregate_id.as_str()),
        ("order", order_id.as_str())
    );
    assert_eq!(payload["total_amount"], json!(500));
    assert_eq!(payload["tenant"], json!("acme"));
    assert_eq!(headers["tenant"], json!("acme"));
    let tp = headers["traceparent"].as_str().unwrap();
    let parent = demo::trace_context::parse(tp).expect("valid traceparent");
    assert_eq!(parent.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_ne!(tp, incoming, "a new span id for this hop");

    // Payments: 202, Location, pending; GET shows the state; events without an incoming trace
    // start a new one.
    let order_uuid: Uuid = order_id.parse().unwrap();
    let p = api
        .post(
            "/payments",
            Some(&api.a),
            Some("pay"),
            &payment_body(order_uuid, json!("500")),
        )
        .await;
    assert_eq!(p.status, 202, "{}", p.body);
    let accepted = p.json();
    assert_eq!(accepted["status"], json!("pending"));
    assert_eq!(accepted["amount"], json!(500));
    let location = p.header("location").unwrap().to_owned();
    assert_eq!(
        location,
        format!("/payments/{}", accepted["id"].as_str().unwrap())
    );
    let got = api.get(&location, Some(&api.a)).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["status"], json!("pending"));
    assert_eq!(api.get(&location, Some(&api.b)).await.status, 404);
    let (aggregate_type, aggregate_id, headers): (String, String, Value) = sqlx::query_as(
        "SELECT aggregate_type, aggregate_id, headers FROM outbox.messages WHERE event_type = 'payment.requested'",
    )
    .fetch_one(&api.db.pool)
    .await
    .unwrap();
    assert_eq!(aggregate_type, "payment");
    assert_eq!(aggregate_id, accepted["id"].as_str().unwrap());
    let tp = headers["traceparent"].as_str().unwrap();
    assert_ne!(
        demo::trace_context::parse(tp)
            .expect("valid traceparent")
            .trace_id,
        parent.trace_id
    );
    let replay = api
        .post(
            "/payments",
            Some(&api.a),
            Some("pay"),
            &payment_body(order_uuid, json!(500)),
        )
        .await;
    assert_eq!(
        (replay.status, replay.header("location")),
        (202, Some(location.as_str()))
    );
    assert_eq!(replay.body, mark_replayed(&p.body));

    // Not found, however the id looks.
    for path in [
        "/orders/not-a-uuid",
        "/payments/00000000-0000-0000-0000-000000000000",
    ] {
        let r = api.get(path, Some(&api.a)).await;
        assert_eq!(r.status, 404, "{path}");
        assert_error_shape(&r);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_routes_metrics_openapi_and_fallbacks() {
    let api = start(Options::default()).await;
    api.order("m").await;
    assert_eq!(api.get("/healthz", None).await.status, 200);
    let ready = api.get("/readyz", None).await;
    assert_eq!(ready.status, 200, "{}", ready.body);
    assert_eq!(ready.json()["postgres"], json!(true));

    let metrics = api.get("/metrics", None).await.body;
    assert!(
        metrics.contains(
            r#"api_request_duration_seconds_bucket{route="/orders",method="POST",status="201""#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"api_idempotency_outcomes_total{operation="create_order",outcome="new"} 1"#
        ),
        "{metrics}"
    );

    let doc = api.get("/openapi.json", None).await;
    assert_eq!(doc.status, 200);
    let doc = doc.json();
    for path in ["/orders", "/orders/{id}", "/payments", "/payments/{id}"] {
        assert!(
            doc["paths"][path].is_object(),
            "{path} missing from OpenAPI"
        );
    }
    assert!(doc["components"]["schemas"]["CreatePaymentRequest"].is_object());
    assert!(doc["components"]["securitySchemes"]["api_key"].is_object());

    let unknown = api.get("/nope", Some(&api.a)).await;
    assert_eq!(unknown.status, 404);
    assert_error_shape(&unknown);
    let wrong_method = api
        .send(
            api.client
                .delete(format!("{}/orders", api.base))
                .bearer_auth(&api.a),
        )
        .await;
    assert_eq!(wrong_method.status, 405);
    assert_error_shape(&wrong_method);
    let metrics = api.get("/metrics", None).await.body;
    assert!(metrics.contains(r#"route="unmatched""#), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_create_command_prints_one_key_that_works() {
    let api = start(Options::default()).await;
    let out = tokio::process::Command::new(bin_path("producer"))
        .args(["api-key", "create", "--tenant", "initech"])
        .env("DATABASE_URL", &api.db.url)
        .env("RUST_LOG", "info")
        .output()
        .await
        .expect("run producer api-key create");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "stdout must hold the key alone: {stdout:?}");
    let key = lines[0];
    assert!(
        key.starts_with("opk_")
            && key.len() == 68
            && key[4..].bytes().all(|b| b.is_ascii_hexdigit()),
        "{key}"
    );
    assert_eq!(
        api.count("SELECT count(*) FROM demo.api_keys WHERE tenant = 'initech'")
            .await,
        1
    );
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM demo.api_keys WHERE key_hash = $1")
        .bind(&demo::auth::hash_api_key(key)[..])
        .fetch_one(&api.db.pool)
        .await
        .unwrap();
    assert_eq!(stored, 1, "stored hashed");

    let r = api.post("/orders", Some(key), Some("cli"), ORDER).await;
    assert_eq!(r.status, 201, "{}", r.body);

    let bad = tokio::process::Command::new(bin_path("producer"))
        .args(["api-key", "create", "--tenant", "no spaces allowed"])
        .env("DATABASE_URL", &api.db.url)
        .output()
        .await
        .unwrap();
    assert!(!bad.status.success());
    assert!(bad.stdout.is_empty());
}

/// sqlx 0.9.0 leaves Nagle's algorithm on, and a statement over one 16 KiB TLS record (a 100-row
/// `enqueue_many`, a relay claim listing the rows it holds) then waited ~40 ms for PostgreSQL's
/// delayed ACK. The vendored sqlx-core sets TCP_NODELAY (vendor/sqlx-core/PATCHED.md): read back
/// from the sockets this process holds to PostgreSQL.
#[tokio::test]
async fn database_connections_are_opened_with_tcp_nodelay() {
    use sqlx::ConnectOptions;
    use std::os::fd::BorrowedFd;
    let db = TestDb::new().await;
    let _held = db.pool.acquire().await.expect("a connection");
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().expect("test database URL");
    let _direct = options.connect().await.expect("a direct connection");
    let port = options.get_port();
    let mut checked = 0;
    for entry in std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
    {
        let Ok(raw) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if !std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
        {
            continue;
        }
        // SAFETY: only read (getpeername, getsockopt); a descriptor closed meanwhile fails them.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        let socket = socket2::SockRef::from(&fd);
        let Some(peer) = socket.peer_addr().ok().and_then(|a| a.as_socket()) else {
            continue;
        };
        if peer.port() != port {
            continue;
        }
        assert!(
            socket.tcp_nodelay().expect("read TCP_NODELAY"),
            "the connection to {peer} has Nagle's algorithm on"
        );
        checked += 1;
    }
    assert!(
        checked >= 2,
        "found {checked} connections to PostgreSQL port {port}, expected the pool's and the direct one"
    );
}
