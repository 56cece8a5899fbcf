//! Looking rather than reading (issue 23, items 5, 6 and 9): a process page opens with its step
//! strip (a retried charge as a lane of ticks, the refund and the release named for what they do,
//! operator actions marked, the full history behind it); the overview is a dashboard (tiles,
//! charts from the console's samples, a refresh toggle); statuses are coloured badges; the audit
//! log shows a diff; every link on these pages leads somewhere (no 404, no 5xx); page weights and
//! render times are measured; and a real Chromium shows the strip and a self-refreshing overview.

use super::*;
use console::config::LookConfig;
use processes::{
    Action as StepAction, Definition, Done, ExternalStep, LocalStep, Remote, RetryPolicy, Step,
    StepContext, StepError, StepFuture,
};
use sqlx::PgConnection;
use std::collections::BTreeSet;
use std::time::Instant;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const KIND: &str = "look_order";

/// A console with every link target configured (trace viewer, remote, Grafana), samples every
/// 300 ms, and `consumers` as CONSOLE_CONSUMERS.
async fn console(consumers: &[&str]) -> Console {
    Console::start_configured(consumers, |c| {
        c.login_attempts_per_minute = 50;
        c.secret_fields = vec![];
        c.look = LookConfig {
            grafana_url: Some("https://grafana.example".into()),
            trace_url: Some("https://traces.example/trace/{trace_id}".into()),
            remote_url: Some("https://provider.example/charges/{ref}".into()),
            sample_interval_ms: 300,
        };
    })
    .await
}

/// A local step that succeeds with its reference.
struct Fine(&'static str);
impl LocalStep for Fine {
    fn run<'a>(&'a self, _: &'a StepContext, _: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async move { Ok(Done::new(self.0)) })
    }
}

/// A local step that fails for good.
struct Refuse;
impl LocalStep for Refuse {
    fn run<'a>(&'a self, _: &'a StepContext, _: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async { Err(StepError::permanent("the order was cancelled meanwhile")) })
    }
}

/// A charge that fails transiently until its attempt `input.charge_attempts`, then succeeds.
struct Charge;
impl ExternalStep for Charge {
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done> {
        Box::pin(async move {
            let needed = ctx.input["charge_attempts"].as_i64().unwrap_or(1) as i32;
            if ctx.attempt < needed {
                return Err(StepError::transient("provider busy (503)"));
            }
            Ok(Done::new(format!("ch_{}", ctx.attempt)))
        })
    }
}
struct Refund;
impl ExternalStep for Refund {
    fn call<'a>(&'a self, _: &'a StepContext) -> StepFuture<'a, Done> {
        Box::pin(async { Ok(Done::new("re_1")) })
    }
}

/// reserve (released by "release") → charge, retried, (refunded by "refund", sensitive) →
/// confirm, which fails: the process compensates and waits for an approver of the refund.
fn definition() -> Definition {
    let retry = RetryPolicy::default()
        .initial(Duration::from_millis(10))
        .max_delay(Duration::from_millis(30))
        .max_attempts(100);
    Definition::new(KIND, 1)
        .step(
            Step::local("reserve", Fine("reserved"))
                .compensate_as("release", StepAction::local(Fine("released"))),
        )
        .step(
            Step::external("charge", Remote::HonoursKey, Charge)
                .retry(retry)
                .compensate_sensitive_as(
                    "refund",
                    StepAction::external(Remote::HonoursKey, Refund),
                ),
        )
        .step(Step::local("confirm", Refuse))
}

/// A payment of order `order` whose charge needs `attempts` attempts, run to its refund's manual
/// review by a worker (stopped before returning). Returns (process id, payment id).
async fn refund_waiting(c: &Console, order: &str, attempts: i64) -> (Uuid, String) {
    let payment = format!("pay-{}", Uuid::new_v4());
    let input = json!({
        "payment_id": payment, "order_id": order, "amount": 1250, "currency": "EUR",
        "charge_attempts": attempts, "traceparent": format!("00-{TRACE_ID}-00f067aa0ba902b7-01"),
    });
    let id = processes::start(&c.db.pool, &definition(), &payment, &input)
        .await
        .unwrap()
        .id;
    let shutdown = CancellationToken::new();
    let registry = processes::Registry::new().with(definition()).unwrap();
    let worker = spawn_worker(&c.db.url, "look-worker", registry, shutdown.clone()).await;
    wait_process(&c.db.pool, id, "manual_review").await;
    shutdown.cancel();
    worker.await.unwrap().unwrap();
    (id, payment)
}

/// Outbox messages of the order and the payment (one of the order's dead), carrying the trace.
async fn events(c: &Console, order: &str, payment: &str) {
    sqlx::query(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, headers) VALUES \
           ('order', $1, 'order.placed', jsonb_build_object('order_id', $1::text), jsonb_build_object('traceparent', $3::text)), \
           ('payment', $2, 'payment.requested', jsonb_build_object('payment_id', $2::text, 'order_id', $1::text), jsonb_build_object('traceparent', $3::text))",
    )
    .bind(order)
    .bind(payment)
    .bind(format!("00-{TRACE_ID}-00f067aa0ba902b7-01"))
    .execute(&c.db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, state, attempts, last_error) \
         VALUES ('order', $1, 'order.reserved', '{}', 'dead', 5, 'broker refused')",
    )
    .bind(order)
    .execute(&c.db.pool)
    .await
    .unwrap();
}

/// `GET path` with the session `cookie`: status, body, and how long the answer took.
async fn page(c: &Console, cookie: &str, path: &str) -> (StatusCode, String, Duration) {
    let t = Instant::now();
    let r = c.web.web_get(cookie, path).await;
    let status = r.status();
    let body = r.text().await.unwrap();
    (status, body, t.elapsed())
}

/// The `href`s of a page, unescaped.
fn hrefs(html: &str) -> Vec<String> {
    html.split("href=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(|h| h.replace("&amp;", "&"))
        .collect()
}

/// Follows every link of every page in `pages` (the console's own with the session; the
/// configured outside ones are checked for their templates): none is a 404 or a 5xx.
async fn follow_every_link(c: &Console, cookie: &str, pages: &[String]) -> usize {
    let mut links = BTreeSet::new();
    for p in pages {
        let (s, body, _) = page(c, cookie, p).await;
        assert_eq!(s, StatusCode::OK, "{p}: {body}");
        links.extend(hrefs(&body));
    }
    for l in &links {
        if let Some(outside) = l.strip_prefix("https://") {
            assert!(
                outside.starts_with("grafana.example/d/")
                    || outside.starts_with(&format!("traces.example/trace/{TRACE_ID}"))
                    || outside.starts_with("provider.example/charges/ch_"),
                "an outside link from a configured template only: {l}"
            );
            continue;
        }
        let path = l.split('#').next().unwrap_or("");
        let path = if path.is_empty() { "/" } else { path };
        assert!(path.starts_with('/'), "a console link: {l}");
        let (s, body, _) = page(c, cookie, path).await;
        assert!(
            s.is_success(),
            "{l} answers {s} (linked from one of {pages:?}): {body}"
        );
    }
    links.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_page_opens_with_its_step_strip_and_every_link_on_the_looked_at_pages_leads_somewhere()
 {
    let c = console(&[]).await;
    let alice = c.user("alice", Role::Approver).await;
    let bob = c.user("bob", Role::Approver).await;
    let order = format!("order-{}", Uuid::new_v4());
    let (id, payment) = refund_waiting(&c, &order, 6).await;
    events(&c, &order, &payment).await;
    let view = c.process_view(&alice, id).await;
    let refund = view["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["role"] == "compensation" && s["status"] == "manual_review")
        .cloned()
        .unwrap_or_else(|| panic!("the refund waits: {view}"));
    // The compensation's label is stored with it.
    let labels: Vec<(i32, String)> = sqlx::query_as(
        "SELECT seq, compensation_label FROM outbox.process_steps WHERE process_id = $1 AND role = 'compensation' ORDER BY seq",
    )
    .bind(id)
    .fetch_all(&c.db.pool)
    .await
    .unwrap();
    assert_eq!(
        labels,
        [(3, "refund".to_string()), (4, "release".to_string())],
        "undone in reverse order, each named for what it does"
    );
    // Alice asks for the refund; Bob approves it: operator actions on the strip.
    let body = c.post_expect(&alice,
            &format!("/api/processes/{id}/actions/run_compensation"),
            json!({"reason": "order cancelled, refund it", "version": view["version"], "step": refund["seq"]}),
            None, StatusCode::ACCEPTED).await;
    let approval = body["approval"].as_str().unwrap().to_string();
    let alice_cookie = login(&c, &alice).await;
    let bob_cookie = login(&c, &bob).await;
    // Approvals waiting for me: Bob's, not Alice's own.
    let (_, mine, _) = page(&c, &alice_cookie, "/").await;
    let (_, bobs, _) = page(&c, &bob_cookie, "/").await;
    assert!(
        mine.contains("<span class=\"figure\" id=\"approvals-for-me\">0</span>"),
        "{mine}"
    );
    assert!(
        bobs.contains("<span class=\"figure\" id=\"approvals-for-me\">1</span>"),
        "{bobs}"
    );
    let (s, _) = c.try_approve(&bob, &approval, "checked the order").await;
    assert_eq!(s, StatusCode::OK);
    // The release is added when the refund is done; nothing runs it here (no worker): the strip
    // still shows the refund approved and what is left.
    let (s, html, _) = page(&c, &bob_cookie, &format!("/processes/{id}")).await;
    assert_eq!(s, StatusCode::OK, "{html}");
    let strip = &html[html.find("<svg id=\"strip\"").expect("a step strip")..];
    let strip = &strip[..strip.find("</svg>").unwrap()];
    assert!(
        html.find("<svg id=\"strip\"") < html.find("id=\"process\""),
        "the strip comes first"
    );
    assert!(strip.contains(">refund<"), "the refund is named: {strip}");
    assert!(!strip.contains("undo charge"), "{strip}");
    let charge_lane = &strip[strip.find("id=\"strip-lane-1\"").unwrap()..];
    let charge_lane = &charge_lane[..charge_lane.find("</g></g>").unwrap_or(charge_lane.len())];
    assert_eq!(
        charge_lane.matches("class=\"tick\"").count(),
        6,
        "one tick per attempt: {charge_lane}"
    );
    assert_eq!(
        charge_lane.matches("fold fold-backoff").count(),
        5,
        "{charge_lane}"
    );
    for action in ["process.run_compensation", "approval.approve"] {
        assert!(
            strip.contains(&format!("data-action=\"{action}\"")),
            "{action} marked: {strip}"
        );
    }
    assert!(
        html.contains("<details id=\"history\">"),
        "the history behind the strip"
    );
    // Badges: failed and succeeded never alike.
    assert!(html.contains("badge badge-bad status-failed"), "{html}");
    assert!(html.contains("badge badge-good status-succeeded"), "{html}");
    assert!(html.contains(&format!("href=\"https://traces.example/trace/{TRACE_ID}\"")));
    assert!(
        html.contains("href=\"https://provider.example/charges/ch_6\""),
        "{html}"
    );
    // The audit log: a diff, and targets linked to their pages.
    let (_, audit, _) = page(&c, &bob_cookie, "/audit").await;
    assert!(audit.contains("class=\"diff-changed\""), "{audit}");
    assert!(
        audit.contains(&format!("href=\"/processes/{id}\"")),
        "{audit}"
    );
    // The payment's messages name its process and its order.
    let (_, messages, _) = page(
        &c,
        &bob_cookie,
        &format!("/messages?aggregate_id={payment}"),
    )
    .await;
    assert!(
        messages.contains(&format!("href=\"/processes/{id}\"")),
        "{messages}"
    );
    assert!(
        messages.contains(&format!("href=\"/messages?aggregate_id={order}\"")),
        "{messages}"
    );
    let n = follow_every_link(
        &c,
        &bob_cookie,
        &[
            "/".into(),
            format!("/processes/{id}"),
            format!("/messages?aggregate_id={payment}"),
            format!("/messages?aggregate_id={order}"),
            "/processes".into(),
            "/audit".into(),
        ],
    )
    .await;
    assert!(n > 20, "{n} links followed");
    // An aggregate id with a control character is refused, never a 5xx.
    let (s, _, _) = page(&c, &bob_cookie, "/messages?aggregate_id=a%00b").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_is_a_dashboard_with_sampled_charts_dlq_tiles_and_a_refresh_toggle() {
    let dl = DeadLetters::declare("console.look", "console.look.events", None).await;
    let name = &dl.name;
    for _ in 0..2 {
        dl.ch
            .basic_publish(
                "".into(),
                dl.topology.dead_letter_queue.as_str().into(),
                Default::default(),
                b"{}",
                Default::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let c = console(&[name]).await;
    let viewer = c.user("vera", Role::Viewer).await;
    let order = format!("order-{}", Uuid::new_v4());
    refund_waiting(&c, &order, 2).await;
    c.dead_rows(3).await;
    let cookie = login(&c, &viewer).await;
    // The sampler writes the figures through the owning crates; the charts draw them.
    let dlq_series = format!("dead_letters:{name}");
    let want = [
        ("manual_review", 1.0),
        ("outbox_dead", 3.0),
        (dlq_series.as_str(), 2.0),
        ("dead_letters", 2.0),
    ];
    wait_until("the latest samples", Duration::from_secs(30), || async {
        let samples: Vec<(String, f64)> = sqlx::query_as(
            "SELECT DISTINCT ON (series) series, value FROM outbox.console_samples ORDER BY series, at DESC",
        )
        .fetch_all(&c.db.pool)
        .await
        .unwrap();
        let latest = |s: &str| samples.iter().find(|x| x.0 == s).map(|x| x.1);
        want.iter()
            .all(|(s, v)| latest(s) == Some(*v))
            .then_some(())
    })
    .await;
    wait_until(
        "two samples in each chart",
        Duration::from_secs(30),
        || async {
            let (_, html, _) = page(&c, &cookie, "/").await;
            let charts = [
                "chart-backlog",
                "chart-review",
                "chart-dead-letters",
                "chart-dead-rows",
            ];
            charts
                .iter()
                .all(|id| {
                    html.split(&format!("id=\"{id}\" data-samples=\""))
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        .and_then(|n| n.parse::<usize>().ok())
                        .is_some_and(|n| n >= 2)
                })
                .then_some(())
        },
    )
    .await;
    let (_, html, _) = page(&c, &cookie, "/").await;
    assert!(!html.contains("http-equiv=\"refresh\""), "off by default");
    for (id, figure) in [("tile-review", "1"), ("tile-dead", "3")] {
        let tile = &html[html.find(&format!("id=\"{id}\"")).unwrap()..];
        assert!(
            tile.contains(&format!("<span class=\"figure\">{figure}</span>")),
            "{id}: {tile}"
        );
    }
    let tile = &html[html
        .find(&format!("id=\"tile-dlq-{name}\""))
        .expect("a DLQ tile")..];
    assert!(tile.contains("<span class=\"figure\">2</span>"), "{tile}");
    assert!(
        html.contains("oldest since") && html.contains("ago"),
        "relative times: {html}"
    );
    assert!(
        html.contains("https://grafana.example/d/processes?viewPanel=20"),
        "{html}"
    );
    assert!(html.contains("href=\"/?refresh=10\""), "{html}");
    let (_, on, _) = page(&c, &cookie, "/?refresh=10").await;
    assert!(
        on.contains("<meta http-equiv=\"refresh\" content=\"10\">"),
        "{on}"
    );
    assert!(on.contains("id=\"refresh-off\""), "{on}");
    let (s, odd, _) = page(&c, &cookie, "/?refresh=%00x").await;
    assert!(
        s.is_success() && !odd.contains("http-equiv"),
        "an unknown interval is off"
    );
    follow_every_link(
        &c,
        &cookie,
        &["/".into(), format!("/dead-letters?consumer={name}")],
    )
    .await;
}

/// Page weight and server render time (the request's round trip on loopback, median of 9) of the
/// overview and of a process with at least 50 history rows. Prints the figures; asserts only
/// sane bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_weight_and_render_time_of_the_overview_and_a_process_with_50_history_rows() {
    let c = console(&[]).await;
    let viewer = c.user("vera", Role::Viewer).await;
    let order = format!("order-{}", Uuid::new_v4());
    let (id, _) = refund_waiting(&c, &order, 25).await;
    let history: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.process_history WHERE process_id = $1")
            .bind(id)
            .fetch_one(&c.db.pool)
            .await
            .unwrap();
    assert!(history >= 50, "{history} history rows");
    c.dead_rows(20).await;
    let cookie = login(&c, &viewer).await;
    for (what, path) in [
        ("overview", "/".to_string()),
        ("process", format!("/processes/{id}")),
    ] {
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..9 {
            let (s, body, t) = page(&c, &cookie, &path).await;
            assert_eq!(s, StatusCode::OK);
            bytes = body.len();
            times.push(t);
        }
        times.sort();
        let median = times[times.len() / 2];
        println!(
            "MEASURE {what} ({path}, {history} history rows): {bytes} bytes, median render {:.1} ms (min {:.1}, max {:.1})",
            median.as_secs_f64() * 1000.0,
            times[0].as_secs_f64() * 1000.0,
            times[times.len() - 1].as_secs_f64() * 1000.0
        );
        assert!(bytes < 500_000, "{what}: {bytes} bytes");
        assert!(median < Duration::from_secs(2), "{what}: {median:?}");
    }
}

/// The step boxes of process `id`'s strip, once its page drew them.
async fn strip_boxes(
    b: &fantoccini::Client,
    base: &str,
    id: Uuid,
) -> Vec<fantoccini::elements::Element> {
    b.goto(&format!("{base}/processes/{id}")).await.unwrap();
    wait_for(b, "strip").await;
    b.find_all(fantoccini::Locator::Css("#strip g.strip-step"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_the_step_strip_shows_and_the_overview_refreshes_itself() {
    let c = console(&[]).await;
    let ap = c.user("approver-anna", Role::Approver).await;
    let order = format!("order-{}", Uuid::new_v4());
    let (id, payment) = refund_waiting(&c, &order, 8).await;
    events(&c, &order, &payment).await;
    let (_driver, b) = chromedriver().await;
    log_in(&b, &c.web.base, &ap).await;
    let boxes = strip_boxes(&b, &c.web.base, id).await;
    assert_eq!(
        boxes.len(),
        5,
        "reserve, charge, confirm, the refund, the release"
    );
    let mut words = Vec::new();
    for g in &boxes {
        words.push(g.text().await.unwrap());
    }
    assert!(
        words[3].contains("refund") && words[4].contains("release"),
        "{words:?}"
    );
    let ticks = b
        .find_all(fantoccini::Locator::Css("#strip-lane-1 g.tick"))
        .await
        .unwrap();
    assert_eq!(ticks.len(), 8, "one tick per charge attempt");
    // The history is behind the strip until opened.
    assert_eq!(text_of(&b, "timeline").await, "", "closed");
    click(&b, "history-toggle").await;
    assert!(text_of(&b, "timeline").await.contains("retryable"));
    let png = b.screenshot().await.unwrap();
    std::fs::write(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/console-step-strip.png"),
        &png,
    )
    .unwrap();
    // The overview, refreshing every 10 s: the page reloads by itself.
    b.goto(&format!("{}/", c.web.base)).await.unwrap();
    follow(&b, "refresh-10").await;
    wait_for(&b, "refresh-off").await;
    let first = text_of(&b, "as-of").await;
    wait_until(
        "the overview reloads by itself",
        Duration::from_secs(30),
        || async {
            let now = b
                .find(fantoccini::Locator::Id("as-of"))
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            (now != first).then_some(())
        },
    )
    .await;
    assert_eq!(text_of(&b, "refresh-state").await, "every 10 s");
    b.screenshot().await.unwrap();

    // A viewer and an operator see the same strip (reading needs no more than the viewer role).
    for (name, role) in [
        ("viewer-vic", Role::Viewer),
        ("operator-olga", Role::Operator),
    ] {
        let token = c.user(name, role).await;
        log_out(&b).await;
        log_in(&b, &c.web.base, &token).await;
        let boxes = strip_boxes(&b, &c.web.base, id).await;
        assert_eq!(boxes.len(), 5, "{name}");
    }
    b.goto(&format!("{}/", c.web.base)).await.unwrap();
    wait_for(&b, "as-of").await;
    screenshot_and_close(b, "console-overview-dashboard.png").await;
}

/// Runs `scripts/up.sh` on the debug binaries (`UP_BIN_DIR`, no release build) in its own
/// process group with its own database, ports and exchange, until it prints that it runs; then
/// sends `signal` (to the script, or with `group` to the whole group, as Ctrl-C does) and
/// returns how long it took until nothing of its process group was left.
async fn up_sh_stops(signal: &str, group: bool) -> Duration {
    use std::os::unix::process::CommandExt;
    let bins = bin_path("producer").parent().unwrap().to_path_buf();
    for b in ["console", "relay", "payment-provider"] {
        bin_path(b);
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let logs = system_tests::TempDir::new("up_logs");
    let db = format!("up_test_{}", Uuid::new_v4().simple());
    let port = || system_tests::free_addr().to_string();
    let metrics = 20_000 + (Uuid::new_v4().as_u128() % 40_000) as u16;
    let out = logs.path().join("up.out");
    // The ledger consumer's queues get a name of their own, deleted with the broker handle.
    let broker = system_tests::TestBroker::new();
    let ledger = broker.queue("up_ledger");
    let default_delays = consumer::Config::new("x", "x", "x").retry_delays;
    system_tests::consumers::track_consumer(&broker, &ledger, &default_delays, None);
    let mut child = std::process::Command::new(root.join("scripts/up.sh"))
        .current_dir(&root)
        .env("UP_BIN_DIR", &bins)
        .env(
            "DATABASE_URL",
            format!("postgres://postgres@127.0.0.1:5432/{db}"),
        )
        .env("API_ADDR", port())
        .env("PROVIDER_ADDR", port())
        .env("CONSOLE_ADDR", port())
        .env("UP_METRICS_PORT", metrics.to_string())
        .env("OUTBOX_EXCHANGE", broker.outbox_exchange("up_test"))
        .env("LOG_DIR", logs.path())
        .env("LEDGER_NAME", &ledger)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    wait_until("up.sh runs", Duration::from_secs(120), || async {
        std::fs::read_to_string(&out)
            .ok()
            .filter(|o| o.contains("\nload: "))
            .map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let target = if group {
        format!("-{pid}")
    } else {
        pid.clone()
    };
    let t = Instant::now();
    let sent = std::process::Command::new("kill")
        .args([&format!("-{signal}"), "--", &target])
        .status()
        .unwrap();
    assert!(sent.success());
    let exited = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t.elapsed() > Duration::from_secs(30) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Everything of its group gone too (a child's own children included), within the same 10 s.
    let group_alive = || {
        std::process::Command::new("kill")
            .args(["-0", "--", &format!("-{pid}")])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    while group_alive() && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = t.elapsed();
    let left_ps = std::process::Command::new("ps")
        .args(["-o", "pid,stat,cmd", "-g", &pid])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let left = group_alive();
    if exited.is_none() || left {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{pid}")])
            .status();
    }
    let _ = std::process::Command::new("psql")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-qc"])
        .arg(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .status();
    assert!(
        exited.is_some(),
        "up.sh still runs 30 s after {signal}: {}",
        std::fs::read_to_string(&out).unwrap_or_default()
    );
    assert!(
        !left,
        "a process of up.sh's group outlived it by 10 s: {left_ps}"
    );
    took
}

/// `scripts/up.sh` stops within 10 s of SIGTERM, and of Ctrl-C (SIGINT to its whole process
/// group), in its run phase, every child with it (issue 23: it ignored SIGTERM for 3½ minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_sh_stops_within_10_s_of_sigterm_or_ctrl_c_while_it_runs() {
    let term = up_sh_stops("TERM", false).await;
    let int = up_sh_stops("INT", true).await;
    println!(
        "MEASURE up.sh stopped {term:?} after SIGTERM, {int:?} after Ctrl-C (SIGINT to the group)"
    );
    assert!(term < Duration::from_secs(10), "SIGTERM: {term:?}");
    assert!(int < Duration::from_secs(10), "Ctrl-C: {int:?}");
}

/// Issue 40, bug 4: one 300-byte event type made the overview 3,413 px wide, and the audit page
/// 2,055 px. Long words without a break (an event type, an aggregate id, an error, a reason) now
/// wrap inside their cells: neither page is wider than the browser's window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_long_unbroken_values_never_make_a_page_wider_than_the_window() {
    let c = console(&[]).await;
    let olga = c.user("olga", Role::Operator).await;
    let long_type = format!("order.{}", "x".repeat(294));
    let long_id = "a".repeat(1000);
    let long_error = format!("unpublishable:{}", "e".repeat(300));
    let ids: Vec<Uuid> = sqlx::query_scalar(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, state, attempts, last_error) \
         VALUES ('order', $1, $2, '{}', 'dead', 1, $3), ('order', $1, 'order.placed', '{}', 'dead', 1, $3) \
         RETURNING id",
    )
    .bind(&long_id)
    .bind(&long_type)
    .bind(&long_error)
    .fetch_all(&c.db.pool)
    .await
    .unwrap();
    let version: i64 =
        sqlx::query_scalar("SELECT xmin::text::bigint FROM outbox.messages WHERE id = $1")
            .bind(ids[1])
            .fetch_one(&c.db.pool)
            .await
            .unwrap();
    let (status, body, _) = c
        .post(
            &olga,
            "/api/outbox/dead/actions/requeue",
            json!({"reason": "r".repeat(400), "items": [{"id": ids[1], "version": version}]}),
            Some(&Uuid::new_v4().to_string()),
        )
        .await;
    assert!(status.is_success(), "{status}: {body}");

    let (_driver, b) = chromedriver().await;
    log_in(&b, &c.web.base, &olga).await;
    for path in ["/", "/audit"] {
        b.goto(&format!("{}{path}", c.web.base)).await.unwrap();
        let widths = b
            .execute(
                "return [document.documentElement.scrollWidth, window.innerWidth];",
                vec![],
            )
            .await
            .unwrap();
        let (page, window) = (widths[0].as_i64().unwrap(), widths[1].as_i64().unwrap());
        assert!(
            page <= window,
            "{path} is {page} px wide in a window of {window} px"
        );
    }
    let html = b.source().await.unwrap();
    assert!(html.contains(&"r".repeat(400)), "the reason is shown whole");
}

/// Issue 40, bug 6: operator actions close in time printed their labels over each other on the
/// strip. Six pauses and resumes within a second, on a process with a long history: in a real
/// browser, no two labels overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_operator_actions_close_in_time_keep_their_labels_apart() {
    let c = console(&[]).await;
    let olga = c.user("olga", Role::Operator).await;
    // A process with a long history (30 charge attempts): the actions share the axis with it.
    let (id, _) = refund_waiting(&c, &format!("order-{}", Uuid::new_v4()), 30).await;
    for (i, action) in ["pause", "resume"].iter().cycle().take(6).enumerate() {
        let version = c.process_view(&olga, id).await["version"].clone();
        c.post_expect(
            &olga,
            &format!("/api/processes/{id}/actions/{action}"),
            json!({"reason": format!("step {i}"), "version": version}),
            None,
            StatusCode::OK,
        )
        .await;
    }
    let (_driver, b) = chromedriver().await;
    log_in(&b, &c.web.base, &olga).await;
    b.goto(&format!("{}/processes/{id}", c.web.base))
        .await
        .unwrap();
    let boxes = b
        .execute(
            "return Array.from(document.querySelectorAll('#strip g.op-mark text')).map(t => { \
               const r = t.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; });",
            vec![],
        )
        .await
        .unwrap();
    let boxes: Vec<Vec<f64>> = serde_json::from_value(boxes).unwrap();
    let marks = b
        .find_all(fantoccini::Locator::Css("#strip g.op-mark"))
        .await
        .unwrap();
    assert_eq!(marks.len(), 6, "a mark per action");
    assert!(!boxes.is_empty(), "some labels are shown");
    for (i, a) in boxes.iter().enumerate() {
        for b2 in &boxes[i + 1..] {
            let apart = a[2] <= b2[0] || b2[2] <= a[0] || a[3] <= b2[1] || b2[3] <= a[1];
            assert!(apart, "labels overlap: {a:?} and {b2:?} of {boxes:?}");
        }
    }
}
