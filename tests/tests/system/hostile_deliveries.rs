//! Deliveries no well-behaved publisher sends, among good ones, published byte by byte with a
//! hand-written AMQP client (lapin refuses to encode most of them): short strings that are not
//! UTF-8, header tables nested thousands of levels deep, unknown field types, headers too large
//! for a dead-letter copy. For each: the consumer keeps its connection (no reconnect) and its
//! process (this test process), the bad delivery is dead-lettered with its reason, and every good
//! one is applied exactly once.

use consumer::screen::Reason;
use consumer::topology::Topology;
use consumer::{Config, Envelope, Handler, HandlerError, Handlers};
use lapin::options::BasicGetOptions;
use sqlx::{PgConnection, PgPool};
use std::time::Duration;
use system_tests::raw_amqp::{self, Answer, RawProperties, RawPublisher};
use system_tests::*;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(60);
const EVENT: &str = "hostile.ok";

/// Inserts one row per application: a message applied twice shows as two rows.
struct Recorder;

impl Handler for Recorder {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO test_applied (message_id) VALUES ($1)")
            .bind(msg.message_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// Waits until the dead-letter queue `dlq` holds a letter (`what` names the wait).
async fn wait_dead_lettered(conn: &lapin::Connection, dlq: &str, what: &str) {
    wait_until(what, LONG, || async move {
        let q = plumbing::amqp::inspect_queue(conn, dlq).await.ok()?;
        (q.message_count() >= 1).then_some(())
    })
    .await;
}

/// A consumer in this process: if a delivery overflowed its stack, this test process would die.
use system_tests::consumers::RunningConsumer as Running;

struct Setup {
    db: TestDb,
    broker: TestBroker,
    exchange: String,
    topology: Topology,
    running: Running,
    publisher: RawPublisher,
}

async fn setup() -> Setup {
    init_logging();
    let db = TestDb::new().await;
    sqlx::query("CREATE TABLE test_applied (message_id uuid NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outbox");
    let name = unique("hostile");
    let mut config = Config::new(&name, amqp_url(), &exchange);
    config.retry_delays = vec![Duration::from_millis(100)];
    config.workers = 1;
    let topology = Topology::new(&name, &config.retry_delays);
    system_tests::consumers::track_consumer(&broker, &name, &config.retry_delays, None);
    let pool = plumbing::db::connect(&db.url, config.pool_size(), "hostile-test")
        .await
        .unwrap();
    let running = Running::start(config, pool, Handlers::new().on("hostile.#", Recorder)).await;
    let publisher = raw_publisher().await;
    Setup {
        db,
        broker,
        exchange,
        topology,
        running,
        publisher,
    }
}

/// Connects the raw publisher with the host and credentials of [`amqp_url`].
async fn raw_publisher() -> RawPublisher {
    let url = amqp_url();
    let rest = url.trim_start_matches("amqp://");
    let (creds, rest) = rest.split_once('@').unwrap_or(("guest:guest", rest));
    let (user, password) = creds.split_once(':').unwrap_or((creds, ""));
    let addr = rest.split('/').next().unwrap_or("127.0.0.1:5672");
    RawPublisher::connect(addr, user, password)
        .await
        .expect("raw AMQP connection")
}

/// A delivery as the relay would publish it: good.
fn good(id: Uuid) -> RawProperties {
    RawProperties {
        content_type: Some(b"application/json".to_vec()),
        delivery_mode: Some(2),
        message_id: Some(id.to_string().into_bytes()),
        kind: Some(EVENT.as_bytes().to_vec()),
        headers: Some(raw_amqp::table(&[
            (b"aggregate_type", raw_amqp::long_string(b"thing")),
            (
                b"aggregate_id",
                raw_amqp::long_string(id.to_string().as_bytes()),
            ),
        ])),
    }
}

async fn publish(s: &mut Setup, props: &RawProperties, body: &[u8]) {
    let answer = s
        .publisher
        .publish(&s.exchange, EVENT.as_bytes(), props, body)
        .await
        .expect("publish");
    assert_eq!(answer, Answer::Acked, "the broker took the delivery");
}

async fn applied(pool: &PgPool) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT message_id FROM test_applied ORDER BY message_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Publishes good, `bad`, good, good; waits until the three good ones are applied and the bad one
/// is in the dead-letter queue; checks that nothing reconnected and each good one applied once.
/// Returns the dead letter.
async fn bad_among_good(
    bad: RawProperties,
    reason: Reason,
    says: &str,
) -> lapin::message::Delivery {
    let mut s = setup().await;
    let ids: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    publish(&mut s, &good(ids[0]), br#"{"n":0}"#).await;
    publish(&mut s, &bad, br#"{"n":"bad"}"#).await;
    publish(&mut s, &good(ids[1]), br#"{"n":1}"#).await;
    publish(&mut s, &good(ids[2]), br#"{"n":2}"#).await;

    let pool = s.db.pool.clone();
    wait_until("the good deliveries applied", LONG, || {
        let pool = pool.clone();
        async move { (applied(&pool).await.len() >= 3).then_some(()) }
    })
    .await;
    let conn = s.broker.connect().await;
    let dlq = s.topology.dead_letter_queue.clone();
    wait_dead_lettered(&conn, &dlq, "the bad delivery dead-lettered").await;
    let ch = conn.create_channel().await.unwrap();
    let letter = ch
        .basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("a dead letter")
        .delivery;
    let headers = letter.properties.headers().clone().unwrap_or_default();
    let kind = plumbing::amqp::header_str(&headers, consumer::message::headers::DEAD_LETTER_KIND);
    assert_eq!(kind.as_deref(), Some("undecodable"));
    let why = plumbing::amqp::header_str(&headers, consumer::message::headers::DEAD_LETTER_REASON)
        .unwrap_or_default()
        .into_owned();
    assert!(
        why.contains(says),
        "dead-letter reason {why:?} should say {says:?}"
    );

    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(
        applied(&s.db.pool).await,
        expected,
        "each good one applied exactly once"
    );
    let stats = s.running.stats.snapshot();
    assert_eq!(stats.reconnects, 0, "the consumer kept its connection");
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(
        stats.rejected,
        1,
        "counted as rejected ({})",
        reason.as_str()
    );
    assert_eq!(stats.processed, 3);
    let _ = conn.close(200, "bye".into()).await;
    s.publisher.close().await;
    let Setup { running, .. } = s;
    running.stop().await;
    letter
}

fn bad_with(edit: impl FnOnce(&mut RawProperties)) -> RawProperties {
    let mut p = good(Uuid::now_v7());
    edit(&mut p);
    p
}

#[tokio::test]
async fn a_message_id_that_is_not_utf8_is_dead_lettered() {
    let bad = bad_with(|p| p.message_id = Some(b"0192d3a4-\xff\xfe-not-utf8".to_vec()));
    bad_among_good(bad, Reason::NotUtf8, "message_id is not valid UTF-8").await;
}

#[tokio::test]
async fn a_type_that_is_not_utf8_is_dead_lettered() {
    let bad = bad_with(|p| p.kind = Some(b"hostile.\xc3\x28".to_vec()));
    bad_among_good(bad, Reason::NotUtf8, "type is not valid UTF-8").await;
}

#[tokio::test]
async fn a_header_name_that_is_not_utf8_is_dead_lettered() {
    let bad = bad_with(|p| {
        p.headers = Some(raw_amqp::table(&[
            (b"aggregate_id", raw_amqp::long_string(b"a-1")),
            (b"bad\xffname", raw_amqp::long_string(b"v")),
        ]))
    });
    let letter = bad_among_good(bad, Reason::NotUtf8, "header name is not valid UTF-8").await;
    // The copy keeps the header, under its lossily decoded name.
    let headers = letter.properties.headers().clone().unwrap_or_default();
    assert!(headers.inner().contains_key("bad\u{fffd}name"));
}

/// A delivery whose header `deep` is a table nested `levels` deep goes to the dead-letter queue
/// among good ones ([`bad_among_good`] with `reason` and `says`); returns what the dead-letter
/// copy holds in `deep`.
async fn nested_header_dead_lettered(levels: usize, reason: Reason, says: &str) -> String {
    let bad = bad_with(|p| {
        p.headers = Some(raw_amqp::table(&[(
            b"deep",
            raw_amqp::nested_table(levels),
        )]))
    });
    let letter = bad_among_good(bad, reason, says).await;
    let headers = letter.properties.headers().clone().unwrap_or_default();
    plumbing::amqp::header_str(&headers, "deep")
        .unwrap_or_default()
        .into_owned()
}

#[tokio::test]
async fn headers_nested_thousands_of_levels_deep_are_dead_lettered() {
    // 15 000 levels: about 105 KB, within one frame; far more than any recursive parser survives.
    let deep =
        nested_header_dead_lettered(15_000, Reason::MalformedHeaders, "could not be parsed").await;
    assert!(deep.starts_with("(removed from this copy"), "{deep}");
}

#[tokio::test]
async fn headers_nested_beyond_the_consumers_bound_are_dead_lettered() {
    let levels = consumer::screen::MAX_HEADER_DEPTH + 4;
    let deep = nested_header_dead_lettered(levels, Reason::TooDeep, "levels deep").await;
    assert!(deep.contains("nested deeper than"), "{deep}");
}

#[tokio::test]
async fn a_header_too_large_for_its_dead_letter_copy_is_cut_from_the_copy() {
    // The original fills its frame exactly; the copy's own headers (reason, kind, time, consumer,
    // attempt) would not fit beside it. (The quorum queue adds `x-delivery-count` on the way: the
    // delivery is a little over frame_max, which the patched lapin tolerates.)
    let frame_max = 131_072usize;
    // Frame: 8 bytes; class, weight, body size: 12; flags: 2; content type, delivery mode,
    // message id, type; the table's length, the name "big", its type and length.
    let fixed = 8 + 12 + 2 + (1 + 16) + 1 + (1 + 36) + (1 + EVENT.len()) + 4 + (1 + 3) + (1 + 4);
    let big = vec![b'x'; frame_max - fixed];
    let bad =
        bad_with(|p| p.headers = Some(raw_amqp::table(&[(b"big", raw_amqp::long_string(&big))])));
    let letter = bad_among_good(bad, Reason::HeadersTooLarge, "headers take").await;
    let headers = letter.properties.headers().clone().unwrap_or_default();
    let cut = plumbing::amqp::header_str(&headers, "big").unwrap_or_default();
    assert_eq!(
        cut,
        format!("(removed from this copy: {} bytes)", 1 + 4 + big.len())
    );
}

/// `consumer dlq list` prints every value escaped: a message id or event type with a newline
/// cannot forge a line.
#[tokio::test]
async fn control_characters_cannot_forge_lines_in_consumer_dlq_list() {
    let mut s = setup().await;
    let forged = "x\n00000000-0000-0000-0000-000000000000  forged  row";
    let bad = RawProperties {
        message_id: Some(forged.as_bytes().to_vec()),
        kind: Some(b"hostile.ok\r\nnext \x1b[2J".to_vec()),
        ..RawProperties::default()
    };
    publish(&mut s, &bad, b"{}").await;
    let conn = s.broker.connect().await;
    let dlq = s.topology.dead_letter_queue.clone();
    wait_dead_lettered(&conn, &dlq, "dead-lettered").await;
    let name = dlq.trim_end_matches(".dlq").to_string();
    let out = tokio::process::Command::new(bin_path("consumer"))
        .args(["--name", &name, "dlq", "list"])
        .env("AMQP_URL", amqp_url())
        .env("DATABASE_URL", &s.db.url)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains('\u{1b}'), "{text}");
    assert!(text.contains(r"x\n00000000"), "{text}");
    assert!(text.contains(r"hostile.ok\r\nnext"), "{text}");
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("00000000-0000-0000-0000-000000000000") || l.starts_with("next")),
        "{text}"
    );
    // Header, one row, the count.
    assert_eq!(text.lines().count(), 3, "{text}");
    let _ = conn.close(200, "bye".into()).await;
    s.publisher.close().await;
    let Setup { running, .. } = s;
    running.stop().await;
}
