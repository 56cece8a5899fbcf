//! Webhooks end to end: the payment provider simulator (a child process) in async mode sends
//! signed events to a `WebhookReceiver` (the `idempotency` crate's, mounted on an axum server in
//! this test process), on one fresh database. Each webhook fault of the simulator; faults
//! combined; a handler that fails or panics (rolled back, retried, applied once); the provider
//! giving up; forged, stale, unsigned, malformed and replayed signatures (refused with a reason,
//! nothing recorded, counted); concurrent duplicates; an older event after a newer one; and a
//! property test that no request makes the receiver panic or answer 5xx.

use axum::Router;
use chrono::{TimeDelta, Utc};
use idempotency::webhooks::{
    HandlerError, InboxOutcome, ObjectVersion, WebhookEvent, WebhookHandler, WebhookReceiver, sign,
};
use payment_provider::api::{Charge, ChargeStatus, DeliveryStatus, EventRecord, EventType};
use payment_provider::client::Client;
use payment_provider::mode::ConfirmationMode;
use proptest::prelude::*;
use serde_json::{Value, json};
use sqlx::PgConnection;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::time::Duration;
use system_tests::{TestDb, demo_stack, unique, wait_until};
use tokio::process::Child;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const SECRET: &str = "whsec_test_0123456789";
/// Generous: the machine is shared and loaded.
const WAIT: Duration = Duration::from_secs(60);
const MAX_BODY: usize = 16 * 1024;

/// What the test service's handler is told to do wrong, and how often it ran.
#[derive(Debug, Default)]
struct Controls {
    /// Fail (after writing its effect, so the rollback is seen) this many more times.
    fail: AtomicU32,
    /// Panic (after writing its effect) this many more times.
    panic: AtomicU32,
    /// Calls of `handle`, committed or not.
    calls: AtomicU32,
}

/// The test service: keeps each charge's status as the webhooks say, in `wh_charges`, ordered by
/// the charge's state (succeeded and failed 1, refunded 2).
struct Charges {
    controls: Arc<Controls>,
}

fn take(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

impl WebhookHandler for Charges {
    fn version(&self, event: &WebhookEvent) -> Option<ObjectVersion> {
        let position = match event.kind.as_str() {
            "charge.refunded" => 2,
            _ => 1,
        };
        Some(ObjectVersion {
            object: event.object_id.clone()?,
            position,
        })
    }

    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &WebhookEvent,
    ) -> Result<(), HandlerError> {
        self.controls.calls.fetch_add(1, Ordering::SeqCst);
        // An event about something else is recorded and ignored: retrying would not help.
        let Ok(charge) = event.object::<Charge>() else {
            return Ok(());
        };
        sqlx::query(
            "INSERT INTO wh_charges (charge_id, status, applied, last_event) VALUES ($1, $2, 1, $3)
             ON CONFLICT (charge_id) DO UPDATE
                SET status = EXCLUDED.status, applied = wh_charges.applied + 1,
                    last_event = EXCLUDED.last_event",
        )
        .bind(charge.id)
        .bind(charge.status.as_str())
        .bind(&event.id)
        .execute(&mut *tx)
        .await?;
        if take(&self.controls.fail) {
            return Err(HandlerError::new("injected handler failure"));
        }
        if take(&self.controls.panic) {
            panic!("injected handler panic");
        }
        Ok(())
    }
}

/// The receiver on an axum server of this process, its controls, its clock offset.
struct Receiver {
    addr: SocketAddr,
    source: String,
    controls: Arc<Controls>,
    /// Seconds added to the receiver's clock (to replay a delivery "later").
    clock_offset: Arc<AtomicI64>,
    shutdown: CancellationToken,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Receiver {
    async fn start(db: &TestDb) -> Self {
        let _ = plumbing::telemetry::metrics_handle();
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS wh_charges (
                 charge_id uuid PRIMARY KEY, status text NOT NULL,
                 applied integer NOT NULL, last_event text NOT NULL)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let source = unique("wh");
        let controls = Arc::new(Controls::default());
        let clock_offset = Arc::new(AtomicI64::new(0));
        let offset = Arc::clone(&clock_offset);
        let receiver = WebhookReceiver::new(
            db.pool.clone(),
            &source,
            SECRET,
            Charges {
                controls: Arc::clone(&controls),
            },
        )
        .max_body(MAX_BODY)
        .clock(Arc::new(move || {
            Utc::now() + TimeDelta::seconds(offset.load(Ordering::SeqCst))
        }));
        let app: Router = Router::new().route("/webhooks/provider", receiver.into_route());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
        });
        Self {
            addr,
            source,
            controls,
            clock_offset,
            shutdown,
        }
    }

    fn url(&self) -> String {
        format!("http://{}/webhooks/provider", self.addr)
    }

    /// POSTs `body` with `signature` (if any) as `Provider-Signature`.
    async fn post(&self, body: &str, signature: Option<&str>) -> (u16, Value) {
        let mut request = reqwest::Client::new()
            .post(self.url())
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(s) = signature {
            request = request.header("provider-signature", s);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// A counter of this receiver's source with the given other label.
    fn counter(&self, name: &str, label: &str, value: &str) -> f64 {
        let rendered = plumbing::telemetry::metrics_handle().render();
        let source = format!("source=\"{}\"", self.source);
        let other = format!("{label}=\"{value}\"");
        rendered
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter(|l| l.contains(&source) && l.contains(&other))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The inbox rows of this source: (event id, type, outcome), oldest first.
    async fn inbox(&self, db: &TestDb) -> Vec<(String, String, String)> {
        sqlx::query_as(
            "SELECT event_id, event_type, outcome FROM outbox.webhook_inbox
              WHERE source = $1 ORDER BY received_at, event_id",
        )
        .bind(&self.source)
        .fetch_all(&db.pool)
        .await
        .unwrap()
    }
}

/// The test service's view of a charge: (status, times applied).
async fn local(db: &TestDb, charge: Uuid) -> Option<(String, i32)> {
    sqlx::query_as("SELECT status, applied FROM wh_charges WHERE charge_id = $1")
        .bind(charge)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

/// The simulator in async mode, sending to `receiver`; `env` adds or overrides settings.
async fn provider(db: &TestDb, receiver: &Receiver, env: &[(&str, &str)]) -> (Child, Client) {
    let url = receiver.url();
    let mut settings: Vec<(&str, &str)> = vec![
        ("PROVIDER_MODE", "async"),
        ("PROVIDER_WEBHOOK_URL", &url),
        ("PROVIDER_WEBHOOK_SECRET", SECRET),
        ("PROVIDER_CONFIRM_DELAY", "200ms"),
        ("PROVIDER_WEBHOOK_BACKOFF", "100ms"),
        ("PROVIDER_WEBHOOK_BACKOFF_MAX", "400ms"),
    ];
    settings.extend_from_slice(env);
    let (child, base) = demo_stack::spawn_provider(db, &settings).await;
    (child, Client::new(&base, Duration::from_secs(30)).unwrap())
}

/// A fresh database, a receiver on it and the simulator (async mode) sending to it, with `env`
/// added: how every fault test starts.
async fn faulted(env: &[(&str, &str)]) -> (TestDb, Receiver, Child, Client) {
    let db = TestDb::new().await;
    let receiver = Receiver::start(&db).await;
    let (child, admin) = provider(&db, &receiver, env).await;
    (db, receiver, child, admin)
}

/// The first event of `charge` once the provider recorded it (`what` names the wait).
async fn first_event(admin: &Client, charge: Uuid, what: &str) -> EventRecord {
    wait_until(what, WAIT, || async {
        admin
            .admin_events(Some(charge))
            .await
            .ok()
            .and_then(|e| e.into_iter().next())
    })
    .await
}

/// `POST /charges` raw (keyed by its reference): the status code and the charge.
async fn charge(provider: &str, reference: &str) -> (u16, Charge) {
    let response = reqwest::Client::new()
        .post(format!("{provider}/charges"))
        .header("idempotency-key", reference)
        .json(&json!({"amount": 1999, "currency": "EUR", "reference": reference}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// The events of `charge` once every one of them is settled (`delivered`, `failed` or `lost`)
/// and there are `n`.
async fn settled_events(admin: &Client, charge: Uuid, n: usize) -> Vec<EventRecord> {
    wait_until("the charge's events are settled", WAIT, || async move {
        let events = admin.admin_events(Some(charge)).await.ok()?;
        (events.len() == n && events.iter().all(|e| e.status != DeliveryStatus::Scheduled))
            .then_some(events)
    })
    .await
}

#[tokio::test]
async fn async_charge_is_pending_until_a_signed_webhook_confirms_it() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(&db).await;
    let url = receiver.url();
    // Starts in sync mode; switched through the admin API.
    let (_child, base) = demo_stack::spawn_provider(
        &db,
        &[
            ("PROVIDER_WEBHOOK_URL", &url),
            ("PROVIDER_WEBHOOK_SECRET", SECRET),
            ("PROVIDER_CONFIRM_DELAY", "1500ms"),
        ],
    )
    .await;
    let admin = Client::new(&base, Duration::from_secs(30)).unwrap();

    let (status, sync) = charge(&base, "wh-sync").await;
    assert_eq!((status, sync.status), (201, ChargeStatus::Succeeded));
    assert_eq!(
        admin.set_mode(ConfirmationMode::Async).await.unwrap(),
        ConfirmationMode::Async
    );

    let (status, pending) = charge(&base, "wh-async").await;
    assert_eq!((status, pending.status), (202, ChargeStatus::Pending));
    let (status, replay) = charge(&base, "wh-async").await;
    assert_eq!(
        (status, replay.id),
        (202, pending.id),
        "a replay while pending"
    );
    assert_eq!(
        admin.get_charge(pending.id).await.unwrap().unwrap().status,
        ChargeStatus::Pending
    );
    assert_eq!(local(&db, pending.id).await, None);

    let events = settled_events(&admin, pending.id, 1).await;
    let e = &events[0];
    assert_eq!(
        (e.kind, e.status, e.attempts, e.sends),
        (EventType::ChargeSucceeded, DeliveryStatus::Delivered, 1, 1)
    );
    assert!(e.id.starts_with("evt_") && e.id.len() == 36, "{}", e.id);
    assert_eq!(e.body["id"], json!(e.id));
    assert_eq!(e.body["type"], "charge.succeeded");
    assert!(
        e.body["created"]
            .as_i64()
            .is_some_and(|t| t > 1_700_000_000)
    );
    assert_eq!(e.body["data"]["object"]["status"], "succeeded");
    assert_eq!(
        admin.get_charge(pending.id).await.unwrap().unwrap().status,
        ChargeStatus::Succeeded
    );
    assert_eq!(local(&db, pending.id).await, Some(("succeeded".into(), 1)));
    assert_eq!(
        receiver.inbox(&db).await,
        vec![(e.id.clone(), "charge.succeeded".into(), "applied".into())]
    );
    assert_eq!(
        receiver.counter("webhook_received_total", "outcome", "applied"),
        1.0
    );
    // The sync charge made no event.
    assert_eq!(admin.admin_events(Some(sync.id)).await.unwrap(), vec![]);
}

#[tokio::test]
async fn faults_combine_a_declined_charge_reported_twice_is_applied_once() {
    let (db, receiver, _child, admin) =
        faulted(&[("PROVIDER_FAULTS", "decline:100,webhook_duplicate:100")]).await;
    let c = admin
        .charge("wh-dup", 500, "EUR", Some("wh-dup"))
        .await
        .unwrap();
    assert_eq!(c.status, ChargeStatus::Pending);
    let events = settled_events(&admin, c.id, 1).await;
    assert_eq!(
        (
            events[0].kind,
            events[0].status,
            events[0].attempts,
            events[0].sends
        ),
        (EventType::ChargeFailed, DeliveryStatus::Delivered, 1, 2)
    );
    assert_eq!(events[0].faults, vec!["webhook_duplicate".to_string()]);
    assert_eq!(local(&db, c.id).await, Some(("declined".into(), 1)));
    assert_eq!(receiver.inbox(&db).await.len(), 1);
    assert_eq!(receiver.controls.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        receiver.counter("webhook_received_total", "outcome", "duplicate"),
        1.0
    );
}

#[tokio::test]
async fn webhook_lost_is_never_sent_but_the_charge_stays_queryable() {
    let (db, receiver, _child, admin) = faulted(&[("PROVIDER_FAULTS", "webhook_lost:100")]).await;
    let c = admin.charge("wh-lost", 500, "EUR", None).await.unwrap();
    let events = settled_events(&admin, c.id, 1).await;
    assert_eq!(
        (events[0].status, events[0].sends, events[0].attempts),
        (DeliveryStatus::Lost, 0, 0)
    );
    // The provider decided; the receiver never heard: only a query (or reconciliation) tells.
    let found = admin.find_by_reference("wh-lost").await.unwrap().unwrap();
    assert_eq!(found.status, ChargeStatus::Succeeded);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(local(&db, c.id).await, None);
    assert!(receiver.inbox(&db).await.is_empty());
}

#[tokio::test]
async fn webhook_delay_holds_the_first_delivery_back() {
    let (db, _receiver, _child, admin) = faulted(&[
        ("PROVIDER_FAULTS", "webhook_delay:100"),
        ("PROVIDER_WEBHOOK_DELAY", "2s"),
    ])
    .await;
    let c = admin.charge("wh-delay", 500, "EUR", None).await.unwrap();
    let recorded = first_event(&admin, c.id, "the event is recorded").await;
    assert_eq!(recorded.status, DeliveryStatus::Scheduled);
    assert_eq!(local(&db, c.id).await, None, "not before the delay");
    let events = settled_events(&admin, c.id, 1).await;
    let e = &events[0];
    let held = e.delivered_at.unwrap() - e.created_at;
    assert!(held >= TimeDelta::seconds(2), "delivered after {held}");
    assert_eq!(local(&db, c.id).await, Some(("succeeded".into(), 1)));
}

#[tokio::test]
async fn webhook_reorder_delivers_the_refund_first_and_the_state_does_not_move_back() {
    let (db, receiver, _child, admin) = faulted(&[
        ("PROVIDER_FAULTS", "webhook_reorder:100"),
        ("PROVIDER_WEBHOOK_REORDER_WINDOW", "60s"),
    ])
    .await;
    let c = admin.charge("wh-reorder", 500, "EUR", None).await.unwrap();
    let held = first_event(&admin, c.id, "the decision event is held").await;
    assert!(held.held && held.status == DeliveryStatus::Scheduled);
    admin.refund(c.id).await.unwrap();
    let events = settled_events(&admin, c.id, 2).await;
    let (succeeded, refunded) = (&events[0], &events[1]);
    assert_eq!(
        (succeeded.kind, refunded.kind),
        (EventType::ChargeSucceeded, EventType::ChargeRefunded)
    );
    assert!(!refunded.held, "the later event overtakes");
    assert!(
        refunded.delivered_at < succeeded.delivered_at,
        "refund delivered first: {refunded:?} / {succeeded:?}"
    );
    // The older event came last and was not applied: the charge stays refunded.
    assert_eq!(local(&db, c.id).await, Some(("refunded".into(), 1)));
    assert_eq!(
        receiver.inbox(&db).await,
        vec![
            (
                refunded.id.clone(),
                "charge.refunded".into(),
                "applied".into()
            ),
            (
                succeeded.id.clone(),
                "charge.succeeded".into(),
                "superseded".into()
            ),
        ]
    );
    assert_eq!(
        receiver.counter("webhook_received_total", "outcome", "superseded"),
        1.0
    );
}

#[tokio::test]
async fn webhook_5xx_retry_sends_again_and_the_receiver_applies_once() {
    let (db, receiver, _child, admin) =
        faulted(&[("PROVIDER_FAULTS", "webhook_5xx_retry:100")]).await;
    let c = admin.charge("wh-5xx", 500, "EUR", None).await.unwrap();
    let events = settled_events(&admin, c.id, 1).await;
    assert_eq!(
        (events[0].status, events[0].attempts, events[0].sends),
        (DeliveryStatus::Delivered, 2, 2)
    );
    assert!(
        events[0]
            .last_response
            .as_deref()
            .is_some_and(|r| r.starts_with("200")),
        "{events:?}"
    );
    assert_eq!(local(&db, c.id).await, Some(("succeeded".into(), 1)));
    assert_eq!(receiver.inbox(&db).await.len(), 1);
    assert_eq!(
        receiver.counter("webhook_received_total", "outcome", "duplicate"),
        1.0
    );
}

#[tokio::test]
async fn webhook_5xx_retry_and_webhook_duplicate_combine() {
    let (db, receiver, _child, admin) = faulted(&[(
        "PROVIDER_FAULTS",
        "webhook_5xx_retry:100,webhook_duplicate:100",
    )])
    .await;
    let c = admin.charge("wh-5xx-dup", 500, "EUR", None).await.unwrap();
    let events = settled_events(&admin, c.id, 1).await;
    // Attempt 1 (counted as failed), attempt 2 (2xx), then its duplicate.
    assert_eq!(
        (events[0].status, events[0].attempts, events[0].sends),
        (DeliveryStatus::Delivered, 2, 3)
    );
    assert_eq!(local(&db, c.id).await, Some(("succeeded".into(), 1)));
    assert_eq!(
        receiver.counter("webhook_received_total", "outcome", "duplicate"),
        2.0
    );
}

#[tokio::test]
async fn a_restarted_provider_still_decides_and_delivers_what_was_pending() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(&db).await;
    let (mut child, admin) = provider(&db, &receiver, &[("PROVIDER_CONFIRM_DELAY", "3s")]).await;
    let c = admin.charge("wh-restart", 500, "EUR", None).await.unwrap();
    assert_eq!(c.status, ChargeStatus::Pending);
    child.kill().await.unwrap();
    let (_child, admin) = provider(&db, &receiver, &[("PROVIDER_CONFIRM_DELAY", "3s")]).await;
    let events = settled_events(&admin, c.id, 1).await;
    assert_eq!(events[0].status, DeliveryStatus::Delivered);
    assert_eq!(local(&db, c.id).await, Some(("succeeded".into(), 1)));
}

#[tokio::test]
async fn a_failing_or_panicking_handler_rolls_back_and_the_retry_applies_once() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(&db).await;
    receiver.controls.fail.store(1, Ordering::SeqCst);
    receiver.controls.panic.store(1, Ordering::SeqCst);
    let (_child, admin) = provider(&db, &receiver, &[]).await;
    let c = admin.charge("wh-fail", 500, "EUR", None).await.unwrap();
    let events = settled_events(&admin, c.id, 1).await;
    assert_eq!(
        (events[0].status, events[0].attempts),
        (DeliveryStatus::Delivered, 3)
    );
    assert_eq!(receiver.controls.calls.load(Ordering::SeqCst), 3);
    // Each failed attempt wrote its effect and lost it with the inbox row.
    assert_eq!(local(&db, c.id).await, Some(("succeeded".into(), 1)));
    assert_eq!(receiver.inbox(&db).await.len(), 1);
    assert_eq!(
        receiver.counter("webhook_handler_failures_total", "cause", "error"),
        1.0
    );
    assert_eq!(
        receiver.counter("webhook_handler_failures_total", "cause", "panic"),
        1.0
    );
    assert_eq!(
        receiver.counter("webhook_received_total", "outcome", "applied"),
        1.0
    );
}

#[tokio::test]
async fn the_provider_gives_up_after_its_attempt_limit() {
    let db = TestDb::new().await;
    let receiver = Receiver::start(&db).await;
    receiver.controls.fail.store(u32::MAX, Ordering::SeqCst);
    let (_child, admin) = provider(&db, &receiver, &[("PROVIDER_WEBHOOK_MAX_ATTEMPTS", "3")]).await;
    let c = admin.charge("wh-give-up", 500, "EUR", None).await.unwrap();
    let events = settled_events(&admin, c.id, 1).await;
    assert_eq!(
        (events[0].status, events[0].attempts, events[0].sends),
        (DeliveryStatus::Failed, 3, 3)
    );
    assert_eq!(events[0].last_response.as_deref(), Some("500"));
    assert_eq!(local(&db, c.id).await, None);
    assert!(receiver.inbox(&db).await.is_empty());
}

/// A charge event body as the provider sends it.
fn event_body(event_id: &str, charge: Uuid, kind: &str, status: &str) -> String {
    json!({
        "id": event_id,
        "type": kind,
        "created": Utc::now().timestamp(),
        "data": {"object": {
            "id": charge, "reference": "r", "amount": 5, "currency": "EUR", "status": status,
            "created_at": Utc::now(), "refunded_at": null,
        }},
    })
    .to_string()
}

/// A 4xx whose body is only a non-empty `error`.
fn only_error(status: u16, body: &Value, expected: u16, what: &str) {
    assert_eq!(status, expected, "{what}: {body}");
    let object = body.as_object().unwrap_or_else(|| panic!("{what}: {body}"));
    assert_eq!(object.len(), 1, "{what}: {body}");
    assert!(
        object["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{what}: {body}"
    );
}

#[tokio::test]
async fn forged_stale_unsigned_malformed_and_replayed_signatures_are_refused_and_counted() {
    let db = TestDb::new().await;
    let r = Receiver::start(&db).await;
    let charge = Uuid::new_v4();
    let body = event_body("evt_sig_1", charge, "charge.succeeded", "succeeded");
    let now = Utc::now().timestamp();

    let (s, b) = r.post(&body, None).await;
    only_error(s, &b, 401, "unsigned");
    let (s, b) = r.post(&body, Some("t=oops")).await;
    only_error(s, &b, 400, "malformed");
    let forged = sign(b"not the secret", now, body.as_bytes());
    let (s, b) = r.post(&body, Some(&forged)).await;
    only_error(s, &b, 401, "forged");
    let tampered = sign(SECRET.as_bytes(), now, body.as_bytes());
    let (s, b) = r
        .post(&body.replace("succeeded", "refunded"), Some(&tampered))
        .await;
    only_error(s, &b, 401, "body changed after signing");
    let stale = sign(SECRET.as_bytes(), now - 301, body.as_bytes());
    let (s, b) = r.post(&body, Some(&stale)).await;
    only_error(s, &b, 401, "stale");
    assert!(b["error"].as_str().unwrap().contains("tolerance"), "{b}");
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(MAX_BODY));
    let (s, b) = r
        .post(&big, Some(&sign(SECRET.as_bytes(), now, big.as_bytes())))
        .await;
    only_error(s, &b, 413, "too large");
    let no_id = r#"{"type":"charge.succeeded"}"#;
    let (s, b) = r
        .post(no_id, Some(&sign(SECRET.as_bytes(), now, no_id.as_bytes())))
        .await;
    only_error(s, &b, 400, "signed but no event id");
    assert!(r.inbox(&db).await.is_empty(), "nothing recorded");
    assert_eq!(local(&db, charge).await, None, "no state change");

    // A real delivery, replayed: at once it is a duplicate, after the tolerance it is refused.
    let signed = sign(SECRET.as_bytes(), now, body.as_bytes());
    let (s, b) = r.post(&body, Some(&signed)).await;
    assert_eq!((s, b), (200, json!({"outcome": "applied"})));
    let (s, b) = r.post(&body, Some(&signed)).await;
    assert_eq!((s, b), (200, json!({"outcome": "duplicate"})));
    r.clock_offset.store(301, Ordering::SeqCst);
    let (s, b) = r.post(&body, Some(&signed)).await;
    only_error(s, &b, 401, "replayed after the tolerance");
    assert_eq!(local(&db, charge).await, Some(("succeeded".into(), 1)));
    assert_eq!(r.inbox(&db).await.len(), 1);

    let failures = |reason| r.counter("webhook_signature_failures_total", "reason", reason);
    assert_eq!(failures("unsigned"), 1.0);
    assert_eq!(failures("malformed"), 1.0);
    assert_eq!(failures("mismatch"), 2.0);
    assert_eq!(failures("stale"), 2.0);
    assert_eq!(
        r.counter("webhook_refused_total", "reason", "body_too_large"),
        1.0
    );
    assert_eq!(
        r.counter("webhook_refused_total", "reason", "bad_payload"),
        1.0
    );
    assert_eq!(
        r.counter("webhook_received_total", "outcome", "duplicate"),
        1.0
    );
}

#[tokio::test]
async fn concurrent_deliveries_of_one_event_apply_it_once() {
    let db = TestDb::new().await;
    let r = Arc::new(Receiver::start(&db).await);
    let charge = Uuid::new_v4();
    let body = event_body("evt_race", charge, "charge.succeeded", "succeeded");
    let signed = sign(SECRET.as_bytes(), Utc::now().timestamp(), body.as_bytes());
    let answers = futures::future::join_all((0..10).map(|_| {
        let (r, body, signed) = (Arc::clone(&r), body.clone(), signed.clone());
        async move { r.post(&body, Some(&signed)).await }
    }))
    .await;
    let outcome = |o: InboxOutcome| {
        answers
            .iter()
            .filter(|(s, b)| *s == 200 && b["outcome"] == o.as_str())
            .count()
    };
    assert_eq!(
        (
            outcome(InboxOutcome::Applied),
            outcome(InboxOutcome::Duplicate)
        ),
        (1, 9),
        "{answers:?}"
    );
    assert_eq!(local(&db, charge).await, Some(("succeeded".into(), 1)));
    assert_eq!(r.controls.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_purge_forgets_old_events_but_their_objects_keep_them_from_moving_back() {
    let db = TestDb::new().await;
    let r = Receiver::start(&db).await;
    let charge = Uuid::new_v4();
    let body = event_body("evt_purged", charge, "charge.succeeded", "succeeded");
    let signed = sign(SECRET.as_bytes(), Utc::now().timestamp(), body.as_bytes());
    assert_eq!(r.post(&body, Some(&signed)).await.1["outcome"], "applied");
    let purged = idempotency::webhooks::inbox::purge(
        &db.pool,
        &shared::schema::Schema::default(),
        Utc::now() + TimeDelta::seconds(1),
        1,
    )
    .await
    .unwrap();
    assert!(purged >= 1, "{purged}");
    assert!(r.inbox(&db).await.is_empty());
    // Redelivered after the purge: recorded again, but not applied again.
    assert_eq!(
        r.post(&body, Some(&signed)).await.1["outcome"],
        "superseded"
    );
    assert_eq!(local(&db, charge).await, Some(("succeeded".into(), 1)));
}

/// The background purge (the demo API runs it every `PURGE_INTERVAL_SECS` with
/// `WEBHOOK_INBOX_RETENTION`) keeps what is younger than the retention and deletes what is older,
/// and stops with its shutdown.
#[tokio::test]
async fn the_purge_loop_keeps_events_younger_than_the_retention() {
    let db = TestDb::new().await;
    let r = Receiver::start(&db).await;
    let body = event_body("evt_loop", Uuid::new_v4(), "charge.succeeded", "succeeded");
    let signed = sign(SECRET.as_bytes(), Utc::now().timestamp(), body.as_bytes());
    assert_eq!(r.post(&body, Some(&signed)).await.1["outcome"], "applied");
    let run = |retention: Duration| {
        let stop = CancellationToken::new();
        let task = tokio::spawn(idempotency::webhooks::inbox::purge_loop(
            db.pool.clone(),
            shared::schema::Schema::default(),
            retention,
            Duration::from_millis(50),
            100,
            stop.clone().cancelled_owned(),
        ));
        (stop, task)
    };
    let (stop, task) = run(Duration::from_secs(3600));
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    task.await.unwrap();
    assert_eq!(r.inbox(&db).await.len(), 1, "younger than an hour: kept");
    let (stop, task) = run(Duration::ZERO);
    let p = db.pool.clone();
    wait_until("the inbox purged", Duration::from_secs(10), || {
        let p = p.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.webhook_inbox")
                .fetch_one(&p)
                .await
                .unwrap();
            (n == 0).then_some(())
        }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the loop stops at shutdown")
        .unwrap();
}

/// POSTs `body` to the demo API with its key and an Idempotency-Key.
async fn api_post(api: &str, key: &str, path: &str, idempotency_key: &str, body: &Value) -> Value {
    let response = reqwest::Client::new()
        .post(format!("{api}{path}"))
        .bearer_auth(key)
        .header("idempotency-key", idempotency_key)
        .json(body)
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "{path}: {}",
        response.status()
    );
    response.json().await.unwrap()
}

#[tokio::test]
async fn the_demo_api_records_the_providers_events_for_its_payments() {
    let db = TestDb::new().await;
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let settings = demo::Settings {
        purge_interval: None,
        provider_webhook_secret: Some(demo::provider_webhooks::WebhookSecret(SECRET.into())),
        ..demo::Settings::default()
    };
    let server = demo::start(
        demo::AppState::new(db.pool.clone(), settings),
        "127.0.0.1:0".parse().unwrap(),
        shutdown.clone(),
    )
    .await
    .unwrap();
    let api = format!("http://{}", server.local_addr());
    let key = demo::auth::create_api_key(&db.pool, "acme").await.unwrap();
    let order = api_post(
        &api,
        &key,
        "/orders",
        "o-1",
        &json!({"customer_id": "c", "currency": "EUR",
                "items": [{"sku": "s", "quantity": 1, "unit_price": 500}]}),
    )
    .await;
    let payment = api_post(
        &api,
        &key,
        "/payments",
        "p-1",
        &json!({"order_id": order["id"], "amount": 500, "currency": "EUR"}),
    )
    .await;
    let payment_id: Uuid = payment["id"].as_str().unwrap().parse().unwrap();

    let webhook_url = format!("{api}/webhooks/provider");
    let (_child, base) = demo_stack::spawn_provider(
        &db,
        &[
            ("PROVIDER_MODE", "async"),
            ("PROVIDER_WEBHOOK_URL", &webhook_url),
            ("PROVIDER_WEBHOOK_SECRET", SECRET),
            ("PROVIDER_CONFIRM_DELAY", "200ms"),
            ("PROVIDER_FAULTS", "webhook_duplicate:100"),
        ],
    )
    .await;
    let admin = Client::new(&base, Duration::from_secs(30)).unwrap();
    // The payment's own charge (its reference is the payment id), and a stranger's.
    let ours = admin
        .charge(&payment_id.to_string(), 500, "EUR", None)
        .await
        .unwrap();
    let theirs = admin
        .charge("not-a-payment", 700, "EUR", None)
        .await
        .unwrap();
    for c in [&ours, &theirs] {
        let events = settled_events(&admin, c.id, 1).await;
        assert_eq!(
            (events[0].status, events[0].sends),
            (DeliveryStatus::Delivered, 2)
        );
    }
    let recorded: Vec<(Option<Uuid>, Uuid, String, String)> = sqlx::query_as(
        "SELECT payment_id, charge_id, type, charge_status FROM demo.payment_events
          ORDER BY amount",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        recorded,
        vec![
            (
                Some(payment_id),
                ours.id,
                "charge.succeeded".into(),
                "succeeded".into()
            ),
            (
                None,
                theirs.id,
                "charge.succeeded".into(),
                "succeeded".into()
            ),
        ]
    );
    let inbox: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.webhook_inbox WHERE source = 'payment-provider'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(inbox, 2, "each event once, although sent twice");
    // Unsigned posts are refused, without the API key middleware in the way.
    let r = reqwest::Client::new()
        .post(&webhook_url)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

/// Headers a hostile sender might try.
fn signature_header() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        proptest::collection::vec(any::<u8>(), 0..200).prop_map(Some),
        "(t=[0-9]{0,14}|v1=[0-9a-fA-F]{0,70}|[a-z0-9]{0,4}=[^,]{0,10}|,){0,20}"
            .prop_map(|s| Some(s.into_bytes())),
    ]
}

/// Bodies: arbitrary bytes, arbitrary JSON, and envelope-shaped JSON with odd fields.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let json_leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,300}".prop_map(Value::from),
    ];
    let json = json_leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::hash_map(".{0,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..400),
        json.clone().prop_map(|v| v.to_string().into_bytes()),
        (".{0,300}", ".{0,300}", json.clone(), json.clone()).prop_map(
            |(id, kind, created, object)| {
                json!({"id": id, "type": kind, "created": created, "data": {"object": {"id": object}}})
                    .to_string()
                    .into_bytes()
            }
        ),
        // Well-formed envelopes with an arbitrary object: these reach the inbox and the handler.
        ("evt_[a-z0-9]{1,12}", "[a-z]{1,8}\\.[a-z]{1,8}", "[a-z0-9-]{1,40}", json).prop_map(
            |(id, kind, object, extra)| {
                json!({"id": id, "type": kind, "created": 1_700_000_000,
                       "data": {"object": {"id": object, "extra": extra}}})
                .to_string()
                .into_bytes()
            }
        ),
    ]
}

/// No body or header makes the receiver panic or answer 5xx, signed correctly or not; a 4xx
/// always says why and nothing else. One database and receiver for every case.
#[test]
fn arbitrary_requests_never_panic_or_5xx() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (db, r) = rt.block_on(async {
        let db = TestDb::new().await;
        let r = Receiver::start(&db).await;
        (db, r)
    });
    let http = reqwest::Client::new();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &(signature_header(), body(), any::<bool>()),
            |(header, body, sign_it)| {
                rt.block_on(async {
                    let mut request = http.post(r.url()).body(body.clone());
                    if sign_it {
                        let s = sign(SECRET.as_bytes(), Utc::now().timestamp(), &body);
                        request = request.header("provider-signature", s);
                    } else if let Some(h) = header.as_deref()
                        && let Ok(v) = reqwest::header::HeaderValue::from_bytes(h)
                    {
                        request = request.header("provider-signature", v);
                    }
                    let response = request.send().await.unwrap();
                    let status = response.status().as_u16();
                    let answer: Value = response.json().await.unwrap_or(Value::Null);
                    prop_assert!(
                        status < 500,
                        "{} {} for {:?}",
                        status,
                        answer,
                        String::from_utf8_lossy(&body)
                    );
                    if status >= 400 {
                        only_error(status, &answer, status, "refusal");
                    } else {
                        prop_assert_eq!(status, 200);
                    }
                    Ok(())
                })
            },
        )
        .unwrap();
    assert_eq!(
        r.counter("webhook_handler_failures_total", "cause", "database"),
        0.0
    );
    // The cases reached every stage: refused signatures, signed garbage, recorded events.
    assert!(r.counter("webhook_signature_failures_total", "reason", "malformed") > 0.0);
    assert!(r.counter("webhook_refused_total", "reason", "bad_payload") > 0.0);
    assert!(r.counter("webhook_received_total", "outcome", "applied") > 0.0);
    drop(r);
    rt.block_on(async move { drop(db) });
}
