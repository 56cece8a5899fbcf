//! The `idempotency` layer on a route defined only here: its own tiny effect table, an outbox
//! message in the handed transaction, against real PostgreSQL over real HTTP.

use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use chrono::{DateTime, TimeDelta, Utc};
use futures::future::join_all;
use idempotency::{Effect, Idempotency, IdempotencyError, ResourceId};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use system_tests::TestDb;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const NOTE: &str = r#"{"text":"hello","priority":2}"#;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Note {
    text: String,
    priority: u8,
}

/// What the handler does on its next call(s): fail, panic, or wait at its start.
#[derive(Default)]
struct Faults {
    fail_next: AtomicBool,
    panic_next: AtomicBool,
    /// (entered, gate): the next call notifies `entered` and waits for `gate`.
    hold_next: Mutex<Option<(Arc<Notify>, Arc<Notify>)>>,
    /// The same, but after the next call wrote its effect (its transaction open, the record
    /// locked).
    hold_in_tx_next: Mutex<Option<(Arc<Notify>, Arc<Notify>)>>,
    /// The next call answers this status (with an `error` body) after writing its effect.
    respond_next: Mutex<Option<StatusCode>>,
    calls: AtomicUsize,
}

fn take<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// The route under test: one row in `fx.effects` and one outbox message per effect.
async fn create_note(
    State(faults): State<Arc<Faults>>,
    effect: Effect,
    Extension(note): Extension<Note>,
) -> Result<Response, IdempotencyError> {
    faults.calls.fetch_add(1, Ordering::SeqCst);
    if let Some((entered, gate)) = take(&faults.hold_next) {
        entered.notify_one();
        gate.notified().await;
    }
    let id = Uuid::now_v7();
    let mut tx = effect.tx().await?;
    sqlx::query("INSERT INTO fx.effects (id, scope, text) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(effect.scope())
        .bind(&note.text)
        .execute(&mut *tx)
        .await?;
    let message =
        shared::NewMessage::new("note", id.to_string(), "note.created", json!({"id": id}));
    shared::outbox::enqueue(&mut *tx, &message)
        .await
        .map_err(sqlx::Error::from)?;
    if let Some((entered, gate)) = take(&faults.hold_in_tx_next) {
        entered.notify_one();
        gate.notified().await;
    }
    drop(tx);
    if let Some(status) = take(&faults.respond_next) {
        return Ok((status, Json(json!({"error": "not now"}))).into_response());
    }
    if faults.fail_next.swap(false, Ordering::SeqCst) {
        return Ok((
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": "internal server error"})),
        )
            .into_response());
    }
    if faults.panic_next.swap(false, Ordering::SeqCst) {
        panic!("injected panic in the handler");
    }
    let body = json!({"id": id, "text": note.text, "priority": note.priority, "at": effect.now()});
    Ok((StatusCode::CREATED, ResourceId(id), Json(body)).into_response())
}

/// A clock the test moves.
#[derive(Clone)]
struct TestClock(Arc<Mutex<DateTime<Utc>>>);

impl TestClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn advance(&self, secs: i64) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) += TimeDelta::seconds(secs);
    }
}

struct Service {
    db: TestDb,
    store: Idempotency,
    faults: Arc<Faults>,
    clock: TestClock,
    base: String,
    client: reqwest::Client,
    shutdown: CancellationToken,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: reqwest::header::HeaderMap,
    /// The body as received, byte for byte.
    bytes: Vec<u8>,
    body: String,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
    /// A first answer: 201, not a replay.
    fn assert_fresh(&self) {
        assert_eq!(
            (self.status, self.replayed()),
            (201, false),
            "{}",
            self.body
        );
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

const TTL: Duration = Duration::from_secs(3600);
const LEASE: Duration = Duration::from_secs(30);

async fn start() -> Service {
    let db = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE SCHEMA fx; \
         CREATE TABLE fx.effects (id uuid PRIMARY KEY, scope text NOT NULL, text text NOT NULL)",
    )
    .execute(&db.pool)
    .await
    .expect("create effect table");
    let clock = TestClock(Arc::new(Mutex::new(Utc::now())));
    let store = Idempotency::new(db.pool.clone())
        .ttl(TTL)
        .lease(LEASE)
        .clock({
            let clock = clock.clone();
            Arc::new(move || clock.now())
        });
    let layer = store
        .route("create_note")
        .scope(|parts| {
            let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
            Some(tenant.to_owned())
        })
        .json::<Note>()
        .location(|id| format!("/notes/{id}"));
    let faults = Arc::new(Faults::default());
    let app = Router::new()
        .route("/notes", post(create_note).route_layer(layer))
        .with_state(faults.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
    });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    Service {
        db,
        store,
        faults,
        clock,
        base,
        client,
        shutdown,
    }
}

impl Service {
    async fn post_as(&self, tenant: Option<&str>, key: Option<&str>, body: &str) -> Resp {
        self.send(reqwest::Method::POST, "/notes", tenant, key, body)
            .await
    }

    async fn send(
        &self,
        method: reqwest::Method,
        target: &str,
        tenant: Option<&str>,
        key: Option<&str>,
        body: &str,
    ) -> Resp {
        let mut req = self
            .client
            .request(method, format!("{}{target}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(t) = tenant {
            req = req.header("x-tenant", t);
        }
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        let r = req.send().await.expect("HTTP request");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let bytes = r.bytes().await.expect("read body").to_vec();
        let body = String::from_utf8_lossy(&bytes).into_owned();
        Resp {
            status,
            headers,
            bytes,
            body,
        }
    }

    async fn post(&self, key: &str, body: &str) -> Resp {
        self.post_as(Some("acme"), Some(key), body).await
    }

    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.db.pool)
            .await
            .expect(sql)
    }

    async fn effects(&self) -> i64 {
        self.count("SELECT count(*) FROM fx.effects").await
    }

    async fn messages(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox.messages WHERE event_type = 'note.created'")
            .await
    }

    async fn records(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox.idempotency_keys")
            .await
    }
}

/// Where a held request waits: before its effect transaction, or inside it.
#[derive(Clone, Copy)]
enum Hold {
    BeforeEffect,
    InEffect,
}

/// Starts `POST /notes` with `key` in the background, held where `at` says; returns once it is
/// held, with its response to come and the gate that lets it go on.
async fn post_held(
    svc: &Arc<Service>,
    at: Hold,
    key: &'static str,
) -> (tokio::task::JoinHandle<Resp>, Arc<Notify>) {
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let slot = match at {
        Hold::BeforeEffect => &svc.faults.hold_next,
        Hold::InEffect => &svc.faults.hold_in_tx_next,
    };
    *slot.lock().unwrap() = Some((entered.clone(), gate.clone()));
    let response = tokio::spawn({
        let svc = svc.clone();
        async move { svc.post(key, NOTE).await }
    });
    entered.notified().await;
    (response, gate)
}

/// `r` replays `first`: its status and body bytes, marked `Idempotent-Replayed: true`.
fn assert_replays(r: &Resp, first: &Resp) {
    assert_eq!((r.status, r.replayed()), (first.status, true), "{}", r.body);
    assert_eq!(r.bytes, first.bytes);
}

/// A 4xx body holds exactly one field, `error`, a string.
fn assert_error_only(r: &Resp) {
    assert!((400..500).contains(&r.status), "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    let v = r.json();
    let obj = v.as_object().expect("object body");
    assert_eq!(obj.len(), 1, "{}", r.body);
    assert!(obj["error"].is_string(), "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_identical_requests_make_exactly_one_effect() {
    let svc = Arc::new(start().await);
    // The request that wins the reservation is held in its handler until the other 19 have
    // their answer, so all 20 really overlap.
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    *svc.faults.hold_next.lock().unwrap() = Some((entered.clone(), gate.clone()));
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..20 {
        let (svc, done_tx) = (svc.clone(), done_tx.clone());
        tokio::spawn(async move { done_tx.send(svc.post("same", NOTE).await) });
    }
    entered.notified().await;
    let mut conflicts = Vec::new();
    for _ in 0..19 {
        conflicts.push(done.recv().await.expect("a response"));
    }
    for r in &conflicts {
        assert_eq!(r.status, 409, "while the first is in flight: {r:?}");
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_error_only(r);
    }
    gate.notify_one();
    let fresh = done.recv().await.expect("the held request's response");
    fresh.assert_fresh();

    // Every retry now gets the first response again.
    let retries = join_all((0..19).map(|_| svc.post("same", NOTE))).await;
    for r in &retries {
        assert_replays(r, &fresh);
        assert_eq!(r.header("location"), fresh.header("location"));
    }
    assert_eq!(
        svc.faults.calls.load(Ordering::SeqCst),
        1,
        "the handler ran once"
    );
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.messages().await, 1);
    assert_eq!(
        svc.count("SELECT count(*) FROM outbox.idempotency_keys WHERE status = 'completed'")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_byte_identical_and_another_payload_is_422() {
    let svc = start().await;
    let first = svc.post("k1", NOTE).await;
    assert_eq!(first.status, 201, "{}", first.body);
    assert!(first.header("idempotent-replayed").is_none());
    let id = first.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        first.header("location"),
        Some(format!("/notes/{id}").as_str())
    );

    let second = svc.post("k1", NOTE).await;
    assert_eq!(second.status, first.status);
    assert_eq!(second.bytes, first.bytes, "byte-identical body");
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(second.header("location"), first.header("location"));
    assert_eq!(second.header("content-type"), Some("application/json"));

    // Key order and whitespace do not change the request.
    let reordered = r#"{ "priority" : 2 , "text" : "hello" }"#;
    let third = svc.post("k1", reordered).await;
    assert_replays(&third, &first);

    // Same key, another payload: 422, the original untouched and still replayed.
    let other = svc.post("k1", r#"{"text":"hello","priority":3}"#).await;
    assert_eq!(other.status, 422, "{}", other.body);
    assert_error_only(&other);
    let again = svc.post("k1", NOTE).await;
    assert_eq!(
        (again.status, again.body.as_str()),
        (201, first.body.as_str())
    );

    // Same key and body on another target (here a query string; a path parameter alike) or with
    // another method: another request, 422, never the first one's response.
    let elsewhere = svc
        .send(
            reqwest::Method::POST,
            "/notes?draft=true",
            Some("acme"),
            Some("k1"),
            NOTE,
        )
        .await;
    assert_eq!(elsewhere.status, 422, "{}", elsewhere.body);
    assert_error_only(&elsewhere);

    // Another scope is another key.
    let globex = svc.post_as(Some("globex"), Some("k1"), NOTE).await;
    globex.assert_fresh();

    assert_eq!(svc.faults.calls.load(Ordering::SeqCst), 2);
    assert_eq!(svc.effects().await, 2);
    assert_eq!(svc.messages().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_4xx_with_only_error_and_store_nothing() {
    let svc = start().await;
    let too_long = "k".repeat(256);
    let long_scope = "t".repeat(idempotency::MAX_SCOPE_LEN + 1);
    for (what, tenant, key, body, status) in [
        ("missing key", Some("acme"), None, NOTE, 400),
        ("empty key", Some("acme"), Some(""), NOTE, 400),
        (
            "over-long key",
            Some("acme"),
            Some(too_long.as_str()),
            NOTE,
            400,
        ),
        ("no scope", None, Some("k"), NOTE, 401),
        ("empty scope", Some(""), Some("k"), NOTE, 401),
        (
            "over-long scope",
            Some(long_scope.as_str()),
            Some("k"),
            NOTE,
            401,
        ),
        ("not JSON", Some("acme"), Some("k"), "{not json", 400),
        ("wrong shape", Some("acme"), Some("k"), r#"{"text":1}"#, 422),
        (
            "unknown field",
            Some("acme"),
            Some("k"),
            r#"{"text":"a","priority":1,"x":0}"#,
            422,
        ),
    ] {
        let r = svc.post_as(tenant, key, body).await;
        assert_eq!(r.status, status, "{what}: {}", r.body);
        assert_error_only(&r);
    }
    // Another method: the route's 405, never a stored answer nor a demand for a key.
    for key in [None, Some("k")] {
        let r = svc
            .send(reqwest::Method::PUT, "/notes", Some("acme"), key, NOTE)
            .await;
        assert_eq!(r.status, 405, "{key:?}: {}", r.body);
    }
    assert_eq!(svc.records().await, 0);
    assert_eq!(svc.faults.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_error_releases_the_key_and_the_retry_runs_the_effect_once() {
    let svc = start().await;
    svc.faults.fail_next.store(true, Ordering::SeqCst);
    let failed = svc.post("retry-me", NOTE).await;
    assert_eq!(failed.status, 500, "{}", failed.body);
    // Rolled back and released: no record, no row, no message.
    assert_eq!(svc.records().await, 0);
    assert_eq!(svc.effects().await, 0);
    assert_eq!(svc.messages().await, 0);

    let retry = svc.post("retry-me", NOTE).await;
    retry.assert_fresh();
    let replay = svc.post("retry-me", NOTE).await;
    assert_replays(&replay, &retry);
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.messages().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_releases_the_key() {
    let svc = start().await;
    svc.faults.panic_next.store(true, Ordering::SeqCst);
    let failed = svc.post("panics", NOTE).await;
    assert_eq!(failed.status, 500, "{}", failed.body);
    assert_eq!(failed.json(), json!({"error": "internal server error"}));
    assert_eq!(svc.records().await, 0);
    assert_eq!(svc.effects().await, 0);
    assert_eq!(svc.messages().await, 0);

    let retry = svc.post("panics", NOTE).await;
    retry.assert_fresh();
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.messages().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_taken_over_and_the_old_holder_is_fenced_out() {
    let svc = Arc::new(start().await);
    let (slow, gate) = post_held(&svc, Hold::BeforeEffect, "held").await;

    // In flight with a live lease: 409 + Retry-After.
    let busy = svc.post("held", NOTE).await;
    assert_eq!(busy.status, 409, "{}", busy.body);
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_error_only(&busy);

    // The holder hangs past its lease: a retry takes the record over and runs the effect.
    svc.clock.advance(LEASE.as_secs() as i64 + 1);
    let takeover = svc.post("held", NOTE).await;
    takeover.assert_fresh();

    // The old holder wakes: its transaction is fenced out before it writes anything.
    gate.notify_one();
    let late = slow.await.unwrap();
    assert_eq!(late.status, 409, "{}", late.body);
    assert_error_only(&late);

    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.messages().await, 1);
    let replay = svc.post("held", NOTE).await;
    assert_replays(&replay, &takeover);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_count_as_new_and_are_purged() {
    let svc = Arc::new(start().await);
    let first = svc.post("daily", NOTE).await;
    assert_eq!(first.status, 201);

    // A live reservation (held in flight) is never purged.
    let (held, gate) = post_held(&svc, Hold::BeforeEffect, "in-flight").await;

    assert_eq!(
        svc.store.purge(100, 10).await.unwrap(),
        0,
        "nothing expired yet"
    );
    svc.clock.advance(TTL.as_secs() as i64 + 1);
    assert_eq!(
        svc.store.purge(1, 10).await.unwrap(),
        1,
        "the completed record goes"
    );
    let left: Vec<String> = sqlx::query_scalar("SELECT status FROM outbox.idempotency_keys")
        .fetch_all(&svc.db.pool)
        .await
        .unwrap();
    assert_eq!(left, ["processing"]);

    // The purged key counts as new.
    let anew = svc.post("daily", NOTE).await;
    anew.assert_fresh();
    assert_ne!(anew.json()["id"], first.json()["id"]);

    gate.notify_one();
    let done = held.await.unwrap();
    assert_eq!(done.status, 201, "{}", done.body);
    assert_eq!(svc.effects().await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_depend_on_the_moment_are_not_stored_and_the_retry_runs_anew() {
    let svc = start().await;
    for (n, status) in [409u16, 429, 401, 503].into_iter().enumerate() {
        let key = format!("moment-{n}");
        *svc.faults.respond_next.lock().unwrap() = Some(StatusCode::from_u16(status).unwrap());
        let r = svc.post(&key, NOTE).await;
        assert_eq!(r.status, status, "{}", r.body);
        // Rolled back and released.
        assert_eq!(svc.records().await, n as i64);
        assert_eq!(svc.effects().await, n as i64);
        let retry = svc.post(&key, NOTE).await;
        retry.assert_fresh();
        assert_eq!(svc.effects().await, n as i64 + 1);
    }
    assert_eq!(svc.messages().await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_inside_its_effect_is_alive_past_its_lease_so_a_retry_gets_409_without_waiting() {
    let svc = Arc::new(start().await);
    let (slow, gate) = post_held(&svc, Hold::InEffect, "long").await;

    // Its lease ran out, but its transaction (and the record's row lock) is open: the retry does
    // not queue behind that lock, holding a connection; it answers at once.
    svc.clock.advance(LEASE.as_secs() as i64 + 1);
    let busy = svc.post("long", NOTE).await;
    assert_eq!(busy.status, 409, "{}", busy.body);
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_error_only(&busy);

    gate.notify_one();
    let done = slow.await.unwrap();
    done.assert_fresh();
    let replay = svc.post("long", NOTE).await;
    assert_replays(&replay, &done);
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.faults.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_request_releases_its_key() {
    let svc = Arc::new(start().await);
    let (gone, gate) = post_held(&svc, Hold::InEffect, "gone").await;
    assert_eq!(svc.records().await, 1);
    // The client closes its connection while the effect is open: the server drops the request,
    // its transaction rolls back and its reservation is released.
    gone.abort();
    let _ = gone.await;
    let pool = svc.db.pool.clone();
    system_tests::wait_until(
        "the reservation is released",
        Duration::from_secs(30),
        || {
            let pool = pool.clone();
            async move {
                let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.idempotency_keys")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                (n == 0).then_some(())
            }
        },
    )
    .await;
    assert_eq!(svc.effects().await, 0, "the dropped effect rolled back");

    let retry = svc.post("gone", NOTE).await;
    retry.assert_fresh();
    assert_eq!(svc.effects().await, 1);
    assert_eq!(svc.messages().await, 1);
    gate.notify_one();
}

/// A record stored before fingerprint version 2 (operation and request only) is still replayed to
/// a retry of the same request after the upgrade, and still refuses another one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_with_the_version_1_fingerprint_still_replays() {
    use sha2::Digest;
    let svc = start().await;
    let v1 = idempotency::canonical_json(&json!({
        "v": 1,
        "operation": "create_note",
        "request": {"text": "hello", "priority": 2},
    }));
    let fingerprint: [u8; 32] = sha2::Sha256::digest(v1.as_bytes()).into();
    let stored = r#"{"id":"from-before","text":"hello"}"#;
    let now = svc.clock.now();
    sqlx::query(
        "INSERT INTO outbox.idempotency_keys (scope, operation, key_hash, fingerprint, status, \
           response_status, response_body, created_at, updated_at, expires_at) \
         VALUES ('acme', 'create_note', $1, $2, 'completed', 201, $3, $4, $4, $4 + interval '1 hour')",
    )
    .bind(&idempotency::hash_key("before-upgrade").0[..])
    .bind(&fingerprint[..])
    .bind(stored)
    .bind(now)
    .execute(&svc.db.pool)
    .await
    .unwrap();

    let retry = svc.post("before-upgrade", NOTE).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, true),
        "{}",
        retry.body
    );
    assert_eq!(retry.body, stored);
    let other = svc
        .post("before-upgrade", r#"{"text":"hello","priority":3}"#)
        .await;
    assert_eq!(other.status, 422, "{}", other.body);
    assert_eq!(svc.faults.calls.load(Ordering::SeqCst), 0);
}
