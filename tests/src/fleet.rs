//! Relays and ledger consumers as child processes, steady payment load and the exact ledger check,
//! for the tests that kill brokers, databases and components (cluster failover, database crashes,
//! the fault campaign).

use crate::{bin_path, free_addr, http_status};
use shared::NewMessage;
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::process::{Child, Command};

/// A `relay` or `producer ledger` child process with its metrics address.
pub struct Component {
    pub child: Option<Child>,
    pub metrics: SocketAddr,
    args: Vec<String>,
    env: Vec<(String, String)>,
    program: &'static str,
}

impl Component {
    /// A relay publishing `database_url`'s outbox to `amqp_url` (one URL or a node list), with
    /// retention on (so `relay verify` can reconcile) and short timeouts.
    pub fn relay(database_url: &str, amqp_url: &str, exchange: &str) -> Self {
        let args = [
            "--lease-ms",
            "3000",
            "--poll-interval-ms",
            "100",
            "--confirm-timeout-ms",
            "1500",
            // A quorum queue nacks publishes while it elects a new leader (seconds on a loaded
            // machine) and a nack counts as an attempt: the attempts must outlast a failover.
            "--retry-base-ms",
            "200",
            "--retry-max-ms",
            "2000",
            "--max-attempts",
            "1000",
            "--stats-interval-ms",
            "500",
            "--retention-secs",
            "86400",
        ];
        Self::new(
            "relay",
            args.iter().map(|s| s.to_string()).collect(),
            vec![
                ("DATABASE_URL".into(), database_url.into()),
                ("AMQP_URL".into(), amqp_url.into()),
                ("OUTBOX_EXCHANGE".into(), exchange.into()),
            ],
        )
    }

    /// The example ledger consumer (`producer ledger`) named `name`, bound to `payment.captured`.
    pub fn ledger(database_url: &str, amqp_url: &str, exchange: &str, name: &str) -> Self {
        let args = [
            "ledger",
            "--name",
            name,
            "--bind",
            "payment.captured",
            "--database-url",
            database_url,
            "--amqp-url",
            amqp_url,
            "--exchange",
            exchange,
            "--retry-delays",
            "100ms,200ms",
        ];
        Self::new(
            "producer",
            args.iter().map(|s| s.to_string()).collect(),
            Vec::new(),
        )
    }

    /// The example timeline consumer in ordered mode (`producer timeline --ordered`) named `name`,
    /// with `partitions` partition queues, a 2 s lease, batches of 50, retries after 100 ms and
    /// 200 ms, and `extra` flags.
    pub fn ordered_timeline(
        database_url: &str,
        amqp_url: &str,
        exchange: &str,
        name: &str,
        partitions: u16,
        extra: &[&str],
    ) -> Self {
        let partitions = partitions.to_string();
        let args = [
            "timeline",
            "--name",
            name,
            "--ordered",
            "--partitions",
            &partitions,
            "--lease",
            "2s",
            "--batch-size",
            "50",
            "--retry-delays",
            "100ms,200ms",
            "--database-url",
            database_url,
            "--amqp-url",
            amqp_url,
            "--exchange",
            exchange,
        ];
        Self::new(
            "producer",
            args.iter().chain(extra).map(|s| s.to_string()).collect(),
            Vec::new(),
        )
    }

    /// A `process_worker` (the test definitions of `process_fixtures`) named `id`.
    pub fn process_worker(database_url: &str, id: &str) -> Self {
        Self::new(
            "process_worker",
            Vec::new(),
            vec![
                ("DATABASE_URL".into(), database_url.into()),
                ("WORKER_ID".into(), id.into()),
                ("LEASE_MS".into(), "2000".into()),
            ],
        )
    }

    fn new(program: &'static str, args: Vec<String>, env: Vec<(String, String)>) -> Self {
        let mut c = Self {
            child: None,
            metrics: free_addr(),
            args,
            env,
            program,
        };
        c.start();
        c
    }

    /// Starts the process (again), on the same metrics address.
    pub fn start(&mut self) {
        let mut cmd = Command::new(bin_path(self.program));
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("METRICS_ADDR", self.metrics.to_string())
            .env(
                "RUST_LOG",
                std::env::var("FLEET_LOG").unwrap_or_else(|_| "error".into()),
            )
            .stdout(Stdio::null())
            .kill_on_drop(true);
        if self.program == "producer" {
            cmd.args(["--metrics-addr", &self.metrics.to_string()]);
        }
        self.child = Some(cmd.spawn().expect("spawn component"));
    }

    /// SIGKILL, and wait for the process to be gone.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        }
    }

    /// SIGTERM and wait (bounded) for a clean exit; returns whether it exited successfully.
    pub async fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        if let Some(pid) = child.id() {
            crate::signals::try_signal_pid(pid, "TERM");
        }
        match tokio::time::timeout(Duration::from_secs(60), child.wait()).await {
            Ok(Ok(status)) => status.success(),
            _ => {
                let _ = child.start_kill();
                false
            }
        }
    }

    pub async fn is_ready(&self) -> bool {
        http_status(self.metrics, "/readyz").await == Some(200)
    }

    /// Waits until /readyz answers 200 (panics after `timeout`).
    pub async fn wait_ready(&self, what: &str, timeout: Duration) {
        let addr = self.metrics;
        crate::wait_http_ok(&format!("{what} /readyz 200"), addr, "/readyz", timeout).await;
    }
}

/// One payment event for the ledger.
pub fn payment(account: &str, amount: i64) -> NewMessage {
    NewMessage::new(
        "account",
        account,
        "payment.captured",
        serde_json::json!({"account": account, "amount": amount}),
    )
}

/// Enqueues `n` payments over `accounts` accounts in one transaction (bounded to 10 s); whether
/// it committed. What the ledger must show is read back from the outbox ([`expected_ledger`]), so a
/// commit whose outcome the client never learned (the database died mid-commit) counts right.
pub async fn enqueue_payments(pool: &PgPool, n: usize, accounts: usize, salt: u64) -> bool {
    let batch: Vec<NewMessage> = (0..n)
        .map(|i| {
            let k = (salt as usize).wrapping_mul(7919).wrapping_add(i);
            let amount = ((k % 1000) as i64) - 300;
            payment(&format!("acct-{}", k % accounts), amount)
        })
        .collect();
    let committed = async {
        let mut tx = pool.begin().await.ok()?;
        shared::outbox::enqueue_many(&mut *tx, &batch).await.ok()?;
        tx.commit().await.ok()
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(10), committed).await,
        Ok(Some(()))
    )
}

/// Steady payment load: every 50 ms a transaction of 20 payments over `accounts` accounts
/// ([`enqueue_payments`]), until `stop` is set. A commit that fails (the database is down) is
/// simply not made, and not counted.
pub struct PaymentLoad {
    committed: Arc<AtomicU64>,
    handle: tokio::task::JoinHandle<()>,
}

impl PaymentLoad {
    pub fn start(pool: PgPool, accounts: usize, stop: Arc<AtomicBool>) -> Self {
        let committed = Arc::new(AtomicU64::new(0));
        let c = committed.clone();
        let handle = tokio::spawn(async move {
            let mut salt = 0u64;
            while !stop.load(Ordering::Relaxed) {
                salt += 1;
                if enqueue_payments(&pool, 20, accounts, salt).await {
                    c.fetch_add(20, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Self { committed, handle }
    }

    /// Payments committed so far.
    pub fn committed(&self) -> u64 {
        self.committed.load(Ordering::Relaxed)
    }

    /// Waits (up to `timeout`) until at least `n` payments were committed.
    pub async fn wait_committed(&self, what: &str, n: u64, timeout: Duration) {
        let c = self.committed.clone();
        crate::wait_until(what, timeout, || {
            let c = c.clone();
            async move { (c.load(Ordering::Relaxed) >= n).then_some(()) }
        })
        .await;
    }

    /// Waits for the load to end (after `stop` was set).
    pub async fn join(self) {
        self.handle.await.unwrap();
    }
}

/// Late commits (issue 39): a producer that holds each transaction open for 2-5 s after its
/// inserts, so that the relays move past its rows' positions before they commit. Its payments go
/// to accounts of their own (`late-0` to `late-4`): a held transaction holds its aggregates'
/// counters, and the steady load must not wait for it. A transaction the faults end (a cut link,
/// a database restart) is not counted, as in [`PaymentLoad`].
pub struct LateCommits {
    committed: Arc<AtomicU64>,
    handle: tokio::task::JoinHandle<()>,
}

impl LateCommits {
    pub fn start(pool: PgPool, stop: Arc<AtomicBool>) -> Self {
        let committed = Arc::new(AtomicU64::new(0));
        let c = committed.clone();
        let handle = tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let batch: Vec<NewMessage> = (0..5)
                    .map(|i| payment(&format!("late-{i}"), ((n * 5 + i) % 97) as i64 + 1))
                    .collect();
                let hold = Duration::from_millis(2000 + (n * 7919) % 3000);
                let committed = async {
                    let mut tx = pool.begin().await.ok()?;
                    shared::outbox::enqueue_many(&mut *tx, &batch).await.ok()?;
                    tokio::time::sleep(hold).await;
                    tx.commit().await.ok()
                };
                if matches!(
                    tokio::time::timeout(hold + Duration::from_secs(10), committed).await,
                    Ok(Some(()))
                ) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Self { committed, handle }
    }

    /// Held transactions committed so far.
    pub fn committed(&self) -> u64 {
        self.committed.load(Ordering::Relaxed)
    }

    /// Waits for it to end (after `stop` was set).
    pub async fn join(self) {
        self.handle.await.unwrap();
    }
}

/// Waits (up to `timeout`) until the outbox is drained and the ledger consumers applied every
/// published payment, asserting on the way that nothing was applied twice (`context` is added
/// to that failure, e.g. the seed).
pub async fn wait_drained(pool: &PgPool, timeout: Duration, context: &str) {
    crate::wait_until("outbox drained and the ledger caught up", timeout, || {
        let p = pool.clone();
        async move {
            let pending = outbox_rows(&p, "pending").await?;
            let published = outbox_rows(&p, "published").await?;
            let updates = total_updates(&p).await?;
            assert!(
                updates <= published + pending,
                "applied twice: {updates} updates for {} events{context}",
                published + pending
            );
            (pending == 0 && updates == published).then_some(())
        }
    })
    .await;
}

/// What the ledger must show: every payment committed to the outbox (the relay keeps published
/// rows with retention on), summed per account: account -> (balance, updates).
pub async fn expected_ledger(pool: &PgPool) -> BTreeMap<String, (i64, i64)> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT payload->>'account', sum((payload->>'amount')::bigint)::bigint, count(*) \
         FROM outbox.messages WHERE event_type = 'payment.captured' GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .expect("read the outbox");
    rows.into_iter().map(|(a, b, u)| (a, (b, u))).collect()
}

/// Rows in the outbox in `state`.
pub async fn outbox_rows(pool: &PgPool, state: &str) -> Option<i64> {
    sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE state = $1")
        .bind(state)
        .fetch_one(pool)
        .await
        .ok()
}

/// The ledger as the consumer left it: account -> (balance, updates).
pub async fn ledger(pool: &PgPool) -> BTreeMap<String, (i64, i64)> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT account, balance, updates FROM demo.ledger_balances ORDER BY account",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    rows.into_iter().map(|(a, b, u)| (a, (b, u))).collect()
}

/// Sum of updates over all accounts (None while the database does not answer).
pub async fn total_updates(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT COALESCE(sum(updates), 0)::bigint FROM demo.ledger_balances")
        .fetch_one(pool)
        .await
        .ok()
}

/// Value of one Prometheus series on `addr` (None when absent or not answering). `labels` must
/// all match.
pub async fn metric(addr: SocketAddr, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let body = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let rest = series.strip_prefix(name)?;
            let matches = (rest.is_empty() || rest.starts_with('{'))
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            if matches { value.parse().ok() } else { None }
        })
}

/// A fresh exchange and ledger consumer name on the shared broker, with every object the relay
/// and the consumer will declare tracked for deletion.
pub fn tracked_names(broker: &crate::TestBroker) -> (String, String) {
    let exchange = broker.exchange("outbox");
    broker.track_exchange(&plumbing::amqp::unrouted_name(&exchange));
    broker.track_queue(&plumbing::amqp::unrouted_name(&exchange));
    let name = crate::unique("ledger");
    let t = consumer::topology::Topology::new(
        &name,
        &[Duration::from_millis(100), Duration::from_millis(200)],
    );
    for q in t.queues() {
        broker.track_queue(&q);
    }
    for e in t.exchanges() {
        broker.track_exchange(&e);
    }
    (exchange, name)
}

/// Creates database `name` on a private instance and applies the product's and the example's
/// migrations; a pool on it.
pub async fn migrated_db(pg: &crate::private_pg::PrivatePg, name: &str) -> PgPool {
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&pg.url("postgres"))
        .await
        .expect("connect to the private PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create database");
    let pool = plumbing::db::connect(&pg.url(name), 10, "tests")
        .await
        .expect("connect");
    demo::migrate::run(&pool, &shared::schema::Schema::default())
        .await
        .expect("migrate");
    pool
}

/// Runs `relay verify --format json` for `consumer` over the last day; (exit code, report).
pub fn relay_verify(
    database_url: &str,
    consumer: &str,
    extra: &[&str],
) -> (Option<i32>, serde_json::Value) {
    let out = std::process::Command::new(bin_path("relay"))
        .args([
            "verify",
            "--consumer",
            consumer,
            "--since",
            "1d",
            "--settle",
            "0s",
        ])
        .args(["--format", "json"])
        .args(extra)
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "error")
        .output()
        .expect("run relay verify");
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "relay verify printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), report)
}
