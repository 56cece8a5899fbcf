//! Helpers for the system tests: everything runs against the machine's real PostgreSQL and RabbitMQ.
//!
//! - [`TestDb`]: a fresh, migrated database per test, dropped afterwards.
//! - [`TestBroker`]: randomly named exchanges and queues per test, deleted afterwards.
//! - [`TcpProxy`]: a TCP proxy the test controls, to cut or black-hole a link for real.
//! - [`bin_path`]: the workspace binaries, for tests that kill child processes.
//! - [`wait_until`]: poll a condition with a deadline instead of sleeping.
//! - [`private_pg::PrivatePg`], [`private_rabbit::RabbitNode`]: a PostgreSQL server or RabbitMQ
//!   node (and clusters) of the test's own, to crash and restart.
//! - [`tls_pg`], [`tls_rabbit`]: the same with extra files (certificates), for the TLS tests.
//! - [`pgbouncer::PgBouncer`]: a PgBouncer of the test's own in front of a PostgreSQL server.
//! - [`process_fixtures`]: test process definitions, a fake remote that counts effects, failpoints.
//! - [`raw_amqp`]: a hand-written AMQP publisher for deliveries no client library would encode.
//! - [`fleet`]: relays and ledger consumers as child processes, payment load, the exact ledger.
//! - [`browser`]: headless Chromium through chromedriver, for the console's browser tests.
//! - [`consoles`]: a console in the test's process, with a client for its API and web pages.
//! - [`TempDir`]: a temporary directory removed when dropped.
//! - [`workers`]: `process_worker` child processes, waiting for a process's status.
//! - [`signals`]: SIGTERM and SIGKILL to child processes and process groups.
//! - [`relays`]: a relay in the test's process, or the `relay` binary as a child process.

pub mod browser;
pub mod consoles;
pub mod consumers;
pub mod demo_stack;
pub mod fleet;
pub mod ordering;
pub mod pgbouncer;
pub mod private_pg;
pub mod private_rabbit;
pub mod process_fixtures;
pub mod raw_amqp;
pub mod relays;
pub mod signals;
pub mod tls_pg;
pub mod tls_rabbit;
pub mod wait_fixtures;
pub mod workers;

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use sqlx::PgPool;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Admin connection string (database `test` always exists).
pub fn admin_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// RabbitMQ connection string.
pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A short random name with a prefix, safe for databases, exchanges and queues.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        uuid::Uuid::new_v4().simple().to_string().get(..12).unwrap()
    )
}

/// Initialises logging for tests (RUST_LOG decides; default warnings only).
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A fresh database with all migrations applied. Dropped (with FORCE) when the value is dropped.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    pub async fn new() -> Self {
        let db = Self::new_unmigrated().await;
        // The product's migrations, then the example application's (schema demo).
        demo::migrate::run(&db.pool, &shared::schema::Schema::default())
            .await
            .expect("migrate test db");
        db
    }

    /// A `REPEATABLE READ` transaction that has taken its snapshot (touching no table of ours), as
    /// a report or `pg_dump` holds one: nothing deleted or updated after it can be vacuumed until
    /// it ends.
    pub async fn held_snapshot(&self) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = self.pool.begin().await.expect("begin");
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .expect("repeatable read");
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class")
            .fetch_one(&mut *tx)
            .await
            .expect("take the snapshot");
        tx
    }

    /// The database URL with its host:port replaced (to go through a [`TcpProxy`]).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        let rest = self.url.split_once('@').map(|(_, r)| r).unwrap_or("");
        let path = rest.split_once('/').map(|(_, p)| p).unwrap_or("");
        format!("postgres://postgres@{addr}/{path}")
    }
}

fn replace_db(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("url has a database");
    format!("{base}/{db}")
}

/// Runs `cleanup` to its end on a thread and runtime of its own, for a `Drop` that runs inside
/// the test's runtime: that one is blocked in the drop, so nothing could be awaited on it.
fn on_own_runtime(cleanup: impl Future<Output = ()> + Send + 'static) {
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(cleanup);
    })
    .join();
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin = admin_url();
        // The pool's connections belong to the test's runtime, which is blocked in this drop:
        // closing them from here could wait forever. DROP ... WITH (FORCE) ends them instead.
        on_own_runtime(async move {
            if let Ok(mut conn) = <sqlx::PgConnection as sqlx::Connection>::connect(&admin).await {
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
                .execute(&mut conn)
                .await;
            }
        });
    }
}

/// Exchanges and queues a test created, deleted when dropped.
pub struct TestBroker {
    pub url: String,
    pub exchanges: Mutex<Vec<String>>,
    pub queues: Mutex<Vec<String>>,
}

impl Default for TestBroker {
    fn default() -> Self {
        Self::new()
    }
}

impl TestBroker {
    pub fn new() -> Self {
        Self {
            url: amqp_url(),
            exchanges: Mutex::new(Vec::new()),
            queues: Mutex::new(Vec::new()),
        }
    }
    /// A fresh exchange name, remembered for deletion.
    pub fn exchange(&self, prefix: &str) -> String {
        let n = unique(prefix).replace('_', ".");
        self.exchanges.lock().unwrap().push(n.clone());
        n
    }
    /// Remembers an exchange created by a component (e.g. the relay's alternate exchange).
    pub fn track_exchange(&self, name: &str) {
        self.exchanges.lock().unwrap().push(name.to_string());
    }
    /// A fresh outbox exchange name, remembered for deletion with the alternate exchange and
    /// queue the relay and consumers declare beside it (`<name>.unrouted`).
    pub fn outbox_exchange(&self, prefix: &str) -> String {
        let n = self.exchange(prefix);
        let unrouted = plumbing::amqp::unrouted_name(&n);
        self.track_exchange(&unrouted);
        self.track_queue(&unrouted);
        n
    }
    /// A fresh outbox exchange ([`Self::outbox_exchange`]) declared as the relay declares it,
    /// with its alternate exchange when `alternate`, and the connection that declared it.
    pub async fn declared_outbox(&self, alternate: bool) -> (lapin::Connection, String) {
        let exchange = self.outbox_exchange("outbox");
        let conn = self.connect().await;
        plumbing::amqp::declare_outbox_exchange(&conn, &exchange, alternate)
            .await
            .unwrap();
        (conn, exchange)
    }
    /// A connection that declared outbox `exchange` as the relay declares it (with its alternate
    /// exchange), and a channel of it in confirm mode to publish on.
    pub async fn outbox_publisher(&self, exchange: &str) -> (lapin::Connection, lapin::Channel) {
        let conn = self.connect().await;
        plumbing::amqp::declare_outbox_exchange(&conn, exchange, true)
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        (conn, ch)
    }
    /// A fresh queue name, remembered for deletion.
    pub fn queue(&self, prefix: &str) -> String {
        let n = unique(prefix).replace('_', ".");
        self.queues.lock().unwrap().push(n.clone());
        n
    }
    /// Remembers a queue created by a component.
    pub fn track_queue(&self, name: &str) {
        self.queues.lock().unwrap().push(name.to_string());
    }
    pub async fn connect(&self) -> lapin::Connection {
        plumbing::amqp::connect(&self.url, &Default::default(), "tests")
            .await
            .expect("connect to RabbitMQ")
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        let url = self.url.clone();
        let exchanges = std::mem::take(&mut *self.exchanges.lock().unwrap());
        let queues = std::mem::take(&mut *self.queues.lock().unwrap());
        on_own_runtime(async move {
            let Ok(conn) =
                plumbing::amqp::connect(&url, &Default::default(), "tests-cleanup").await
            else {
                return;
            };
            for q in queues {
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
            }
            for e in exchanges {
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
                        .await;
                }
            }
            let _ = conn.close(200, "bye".into()).await;
        });
    }
}

/// What a [`TcpProxy`] does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward both ways.
    Pass,
    /// Keep connections open but forward nothing (a black-holed link).
    Blackhole,
    /// Close every connection and refuse new ones (a cut link).
    Down,
}

/// A TCP proxy on 127.0.0.1 the test controls.
pub struct TcpProxy {
    pub addr: SocketAddr,
    mode: Arc<Mutex<ProxyMode>>,
    generation: Arc<Mutex<CancellationToken>>,
    stop: CancellationToken,
}

impl TcpProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(Mutex::new(ProxyMode::Pass));
        let generation = Arc::new(Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        let (m, g, s) = (mode.clone(), generation.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = s.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                if *m.lock().unwrap() == ProxyMode::Down {
                    drop(client);
                    continue;
                }
                let cut = g.lock().unwrap().clone();
                let m = m.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let m2 = m.clone();
                    let up = pump(&mut cr, &mut sw, m);
                    let down = pump(&mut sr, &mut cw, m2);
                    tokio::select! {
                        _ = cut.cancelled() => {}
                        _ = up => {}
                        _ = down => {}
                    }
                });
            }
        });
        Self {
            addr,
            mode,
            generation,
            stop,
        }
    }

    pub fn set_mode(&self, mode: ProxyMode) {
        *self.mode.lock().unwrap() = mode;
        if mode == ProxyMode::Down {
            let mut g = self.generation.lock().unwrap();
            g.cancel();
            *g = CancellationToken::new();
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.generation.lock().unwrap().cancel();
    }
}

async fn pump(
    r: &mut tokio::net::tcp::OwnedReadHalf,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    mode: Arc<Mutex<ProxyMode>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Black-holed: swallow bytes until the link passes again.
        if *mode.lock().unwrap() != ProxyMode::Pass {
            continue;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The HTTP status of `GET http://{addr}{path}`, or `None` when nothing answers.
pub async fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    reqwest::get(format!("http://{addr}{path}"))
        .await
        .ok()
        .map(|r| r.status().as_u16())
}

/// A fresh directory under the system's temporary directory, removed (with its contents) when
/// dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `<tmp>/<prefix>_<random>`.
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        Self(dir)
    }
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
    /// Writes file `name` with `contents` into the directory; returns its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits (up to `timeout`) until `GET http://{addr}{path}` answers 200 (a child's `/readyz` or
/// `/healthz`), or panics saying `what`.
pub async fn wait_http_ok(what: &str, addr: SocketAddr, path: &str, timeout: Duration) {
    wait_until(what, timeout, || async move {
        (http_status(addr, path).await == Some(200)).then_some(())
    })
    .await;
}

/// Path of a workspace binary built next to the test executable (`cargo build --bins` first;
/// `scripts/test.sh` does).
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "binary {} not found: build the workspace binaries first (cargo build --bins)",
        path.display()
    );
    path
}

/// Polls `check` every 20 ms until it returns `Some`, or panics with `what` after `timeout`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A free localhost port for a child process's metrics server.
pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

impl TestDb {
    /// A fresh database without migrations (to test that binaries migrate it, concurrently).
    pub async fn new_unmigrated() -> Self {
        Self::new_unmigrated_with("").await
    }

    /// A fresh database without migrations, created with `options` (the rest of a
    /// `CREATE DATABASE`: a template, a locale, ...).
    pub async fn new_unmigrated_with(options: &str) -> Self {
        init_logging();
        let name = unique("t");
        let admin = admin_url();
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
            .await
            .expect("connect admin db");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {name} {options}"
        )))
        .execute(&mut conn)
        .await
        .expect("create test database");
        let url = replace_db(&admin, &name);
        let pool = plumbing::db::connect(&url, 10, "tests")
            .await
            .expect("connect test db");
        Self { name, url, pool }
    }
}

/// A message as a test queue received it.
#[derive(Debug, Clone)]
pub struct Received {
    pub message_id: String,
    pub routing_key: String,
    pub properties: lapin::BasicProperties,
    pub body: serde_json::Value,
}

impl Received {
    /// A delivery as the tests look at it (the body parsed as JSON, `Null` when it is not).
    pub fn from_delivery(d: &lapin::message::Delivery) -> Self {
        Received {
            message_id: d
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_string())
                .unwrap_or_default(),
            routing_key: d.routing_key.as_str().to_string(),
            body: serde_json::from_slice(&d.data).unwrap_or(serde_json::Value::Null),
            properties: d.properties.clone(),
        }
    }

    pub fn header(&self, name: &str) -> Option<String> {
        let h = self.properties.headers().as_ref()?;
        plumbing::amqp::header_str(h, name).map(|c| c.into_owned())
    }
}

/// Message number `n` of `aggregate` (type `test`): its body names both, which is what
/// [`ordering`] and the relay tests check order with.
pub fn msg(aggregate: &str, event_type: &str, n: i64) -> shared::NewMessage {
    shared::NewMessage::new(
        "test",
        aggregate,
        event_type,
        serde_json::json!({ "aggregate": aggregate, "n": n }),
    )
}

/// Messages numbered `ns` (body `{"n": n}`) of type `aggregate_type` and event `event_type`,
/// spread round robin over the aggregates `<prefix>0` to `<prefix><aggregates - 1>`.
pub fn spread(
    aggregate_type: &str,
    event_type: &str,
    prefix: &str,
    aggregates: i64,
    ns: std::ops::Range<i64>,
) -> Vec<shared::NewMessage> {
    ns.map(|n| {
        shared::NewMessage::new(
            aggregate_type,
            format!("{prefix}{}", n % aggregates),
            event_type,
            serde_json::json!({ "n": n }),
        )
    })
    .collect()
}

/// The broker side of [`relayed`]: the connection that declared the exchange and the queue, the
/// queue's name, and the broker (deleting what the test declared when dropped, after the
/// connection: fields drop in this order).
pub struct Declared {
    pub conn: lapin::Connection,
    pub queue: String,
    pub broker: TestBroker,
}

/// What most relay tests start from: a fresh database, the outbox exchange (`alternate`: with its
/// unrouted queue) and queue `q` bound to it with `keys`. Returns the database, the exchange, what
/// arrives in the queue, and the broker side, to keep for the whole test (dropping it deletes what
/// the test declared).
pub async fn relayed(
    alternate: bool,
    keys: &[&str],
) -> (
    TestDb,
    String,
    tokio::sync::mpsc::UnboundedReceiver<Received>,
    Declared,
) {
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(alternate).await;
    let queue = broker.queue("q");
    let rx = collect_queue(&conn, &exchange, &queue, keys).await;
    let declared = Declared {
        conn,
        queue,
        broker,
    };
    (db, exchange, rx, declared)
}

/// Declares `queue` (classic, durable: RabbitMQ 4.3 refuses transient non-exclusive queues and
/// closes the connection; the test's [`TestBroker`] deletes it) bound to `exchange` with `keys`,
/// and returns a stream of everything it receives, acked on receipt.
pub async fn collect_queue(
    conn: &lapin::Connection,
    exchange: &str,
    queue: &str,
    keys: &[&str],
) -> tokio::sync::mpsc::UnboundedReceiver<Received> {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let ch = declare_bound_queue(conn, exchange, queue, keys, durable, FieldTable::default()).await;
    forward_deliveries(ch, queue, 1000, None).await
}

/// Consumes `queue` on `ch` (which it keeps), at most `prefetch` deliveries unacknowledged, and
/// returns a stream of everything it receives: acked on receipt (`no_ack`) when `ack_after` is
/// `None`, else each acked after waiting `ack_after` (a slow consumer).
pub async fn forward_deliveries(
    ch: lapin::Channel,
    queue: &str,
    prefetch: u16,
    ack_after: Option<Duration>,
) -> tokio::sync::mpsc::UnboundedReceiver<Received> {
    use futures::StreamExt;
    use lapin::options::*;
    use lapin::types::FieldTable;
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: ack_after.is_none(),
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let _keep = ch;
        while let Some(Ok(d)) = consumer.next().await {
            if let Some(delay) = ack_after {
                tokio::time::sleep(delay).await;
            }
            let r = Received::from_delivery(&d);
            if ack_after.is_some() && d.acker.ack(Default::default()).await.is_err() {
                return;
            }
            if tx.send(r).is_err() {
                return;
            }
        }
    });
    rx
}

/// Declares `queue` with `options` and `arguments` on a new channel of `conn`, binds it to
/// `exchange` with each of `keys`, and returns the channel.
pub async fn declare_bound_queue(
    conn: &lapin::Connection,
    exchange: &str,
    queue: &str,
    keys: &[&str],
    options: lapin::options::QueueDeclareOptions,
    arguments: lapin::types::FieldTable,
) -> lapin::Channel {
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(queue.into(), options, arguments)
        .await
        .unwrap();
    for k in keys {
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            (*k).into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    }
    ch
}

/// Receives until `n` messages arrived, or panics after `timeout`.
pub async fn receive_n(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Received>,
    n: usize,
    timeout: Duration,
) -> Vec<Received> {
    let mut out = Vec::with_capacity(n);
    let deadline = tokio::time::Instant::now() + timeout;
    while out.len() < n {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(r)) => out.push(r),
            Ok(None) => panic!("queue consumer ended after {} of {n} messages", out.len()),
            Err(_) => panic!(
                "timed out after {timeout:?} with {} of {n} messages",
                out.len()
            ),
        }
    }
    out
}

/// Receives until every message id in `want` arrived at least once (copies included in the
/// result), or panics after `timeout` in all.
pub async fn receive_all_of(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Received>,
    want: &std::collections::HashSet<String>,
    timeout: Duration,
) -> Vec<Received> {
    let mut received = Vec::new();
    receive_rest(rx, &mut received, want, Patience::InAll(timeout), "arrived").await;
    received
}

/// How long [`receive_rest`] waits before it panics.
#[derive(Debug, Clone, Copy)]
pub enum Patience {
    /// For all the missing messages together.
    InAll(Duration),
    /// For each next message.
    Each(Duration),
}

/// Receives into `received` until every message id in `want` is in it (what `received` already
/// holds counts; copies are kept), or panics saying `what` (`only 3 of 5 {what}`) when
/// `patience` runs out.
pub async fn receive_rest(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Received>,
    received: &mut Vec<Received>,
    want: &std::collections::HashSet<String>,
    patience: Patience,
    what: &str,
) {
    let mut got: std::collections::HashSet<String> =
        received.iter().map(|r| r.message_id.clone()).collect();
    let started = tokio::time::Instant::now();
    while !want.is_subset(&got) {
        let deadline = match patience {
            Patience::InAll(timeout) => started + timeout,
            Patience::Each(timeout) => tokio::time::Instant::now() + timeout,
        };
        let r = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| {
                let have = want.intersection(&got).count();
                panic!("only {have} of {} {what} ({patience:?})", want.len())
            })
            .expect("queue consumer running");
        got.insert(r.message_id.clone());
        received.push(r);
    }
}

/// Everything already delivered, without waiting for more than `quiet`.
pub async fn drain(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Received>,
    quiet: Duration,
) -> Vec<Received> {
    let mut out = Vec::new();
    while let Ok(Some(r)) = tokio::time::timeout(quiet, rx.recv()).await {
        out.push(r);
    }
    out
}

/// Waits (up to `timeout`) until no row of the outbox is pending (every row published, dead or
/// removed).
pub async fn wait_no_pending(pool: &PgPool, timeout: Duration) {
    wait_until("no pending row in the outbox", timeout, || async {
        (outbox_count(pool, "pending").await == 0).then_some(())
    })
    .await;
}

/// Number of rows still in the outbox with the given state.
pub async fn outbox_count(pool: &PgPool, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE state = $1")
        .bind(state)
        .fetch_one(pool)
        .await
        .unwrap()
}
