//! The bench's own database, exchange and child processes; all removed at the end.

use crate::Args;
use anyhow::Context;
use lapin::options::{
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use sqlx::PgPool;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;
use tokio::process::{Child, Command};

pub struct BenchEnv {
    pub admin_url: String,
    pub db_name: String,
    pub db_url: String,
    pub pool: PgPool,
    pub amqp_url: String,
    pub exchange: String,
    pub conn: lapin::Connection,
    pub bin_dir: PathBuf,
    pub scale: f64,
    queues: Mutex<Vec<String>>,
}

impl BenchEnv {
    pub async fn new(args: &Args) -> anyhow::Result<Self> {
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..10];
        let db_name = format!("bench_{suffix}");
        let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&args.database_url)
            .await
            .context("connect to PostgreSQL")?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
            .execute(&mut admin)
            .await?;
        // The bench database next to the admin one, with the same parameters (sslmode, ...).
        let (path, params) = match args.database_url.split_once('?') {
            Some((path, params)) => (path, format!("?{params}")),
            None => (args.database_url.as_str(), String::new()),
        };
        let (base, _) = path
            .rsplit_once('/')
            .context("database url has a database")?;
        let db_url = format!("{base}/{db_name}{params}");
        let pool = plumbing::db::connect(&db_url, 8, "bench").await?;
        demo::migrate::run(&pool, &shared::schema::Schema::default()).await?;
        let conn =
            plumbing::amqp_nodes::connect(&args.amqp_url, &Default::default(), "bench").await?;
        let exchange = format!("bench.{suffix}");
        plumbing::amqp::declare_outbox_exchange(&conn, &exchange, true).await?;
        let bin_dir = match &args.bin_dir {
            Some(d) => d.clone(),
            None => std::env::current_exe()?
                .parent()
                .context("exe dir")?
                .to_path_buf(),
        };
        Ok(Self {
            admin_url: args.database_url.clone(),
            db_name,
            db_url,
            pool,
            amqp_url: args.amqp_url.clone(),
            exchange,
            conn,
            bin_dir,
            scale: args.scale,
            queues: Mutex::new(Vec::new()),
        })
    }

    /// `n` scaled, at least `min`.
    pub fn n(&self, n: u64, min: u64) -> u64 {
        ((n as f64 * self.scale) as u64).max(min)
    }

    /// A duration scaled, at least `min`.
    pub fn secs(&self, s: f64, min: f64) -> Duration {
        Duration::from_secs_f64((s * self.scale).max(min))
    }

    /// A durable queue (like a consumer's) bound to the bench exchange with `key`.
    pub async fn queue(&self, name: &str, key: &str) -> anyhow::Result<String> {
        self.declare_queue(name, key, FieldTable::default()).await
    }

    /// A quorum queue (the consumer's queue type) bound to the bench exchange with `key`.
    pub async fn quorum_queue(&self, name: &str, key: &str) -> anyhow::Result<String> {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            lapin::types::AMQPValue::LongString("quorum".into()),
        );
        self.declare_queue(name, key, args).await
    }

    async fn declare_queue(
        &self,
        name: &str,
        key: &str,
        args: FieldTable,
    ) -> anyhow::Result<String> {
        let q = format!("{}.{name}", self.exchange);
        let ch = self.conn.create_channel().await?;
        ch.queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
        ch.queue_bind(
            q.as_str().into(),
            self.exchange.as_str().into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        self.queues.lock().unwrap().push(q.clone());
        Ok(q)
    }

    pub async fn delete_queue(&self, q: &str) {
        if let Ok(ch) = self.conn.create_channel().await {
            let _ = ch
                .queue_delete(q.into(), QueueDeleteOptions::default())
                .await;
        }
    }

    /// Empties the outbox and frees every partition lease.
    pub async fn reset_outbox(&self) -> anyhow::Result<()> {
        sqlx::query("TRUNCATE outbox.messages")
            .execute(&self.pool)
            .await?;
        sqlx::query("UPDATE outbox.relay_partitions SET owner = NULL, lease_until = '-infinity', blocked_until = NULL, blocked_seq = NULL")
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM outbox.relay_instances")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Lets the residue of earlier work settle before a measurement: a checkpoint now (not in the
    /// middle of the measurement, with its full-page writes), then up to 30 s (scaled by
    /// `--scale`) for the machine to go quiet (autovacuum, the broker's cleanup of deleted
    /// queues). Returns how busy the machine still was over the last half second, for the report.
    pub async fn settle(&self) -> anyhow::Result<f64> {
        self.without_timeout(&["CHECKPOINT"]).await?;
        // A smoke run (small --scale) waits at most a second or so.
        let deadline = std::time::Instant::now() + self.secs(30.0, 1.0);
        loop {
            let before = CpuSnapshot::machine();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let busy = CpuSnapshot::machine().busy_since(&before);
            if busy < 0.15 || std::time::Instant::now() >= deadline {
                return Ok(busy);
            }
        }
    }

    /// Runs maintenance statements (CHECKPOINT, VACUUM, bulk fills) on one connection without the
    /// statement timeout the pool sets for everything else.
    pub async fn without_timeout(&self, statements: &[&'static str]) -> anyhow::Result<()> {
        let mut conn = self.pool.acquire().await?;
        sqlx::query("SET statement_timeout = 0")
            .execute(&mut *conn)
            .await?;
        for sql in statements {
            sqlx::query(*sql).execute(&mut *conn).await?;
        }
        sqlx::query("RESET statement_timeout")
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    pub fn bin(&self, name: &str) -> anyhow::Result<PathBuf> {
        let p = self.bin_dir.join(name);
        anyhow::ensure!(
            p.exists(),
            "{} not found: build with `cargo build --release --bins`",
            p.display()
        );
        Ok(p)
    }

    /// Starts a relay process on the bench database and exchange.
    pub fn spawn_relay(&self, extra: &[&str]) -> anyhow::Result<Child> {
        self.spawn("relay", extra, &[])
    }

    /// Starts any workspace binary with the bench's connection settings.
    pub fn spawn(&self, bin: &str, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Child> {
        let mut cmd = Command::new(self.bin(bin)?);
        // BENCH_<BIN>_METRICS_ADDR: scrape that process while a scenario runs.
        let metrics = std::env::var(format!("BENCH_{}_METRICS_ADDR", bin.to_ascii_uppercase()))
            .unwrap_or_else(|_| "127.0.0.1:0".into());
        cmd.args(args)
            .env("DATABASE_URL", &self.db_url)
            .env("AMQP_URL", &self.amqp_url)
            .env("OUTBOX_EXCHANGE", &self.exchange)
            .env("METRICS_ADDR", metrics)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Ok(cmd.spawn()?)
    }

    pub async fn cleanup(&self) {
        let queues = std::mem::take(&mut *self.queues.lock().unwrap());
        for q in queues {
            self.delete_queue(&q).await;
        }
        let unrouted = plumbing::amqp::unrouted_name(&self.exchange);
        self.delete_queue(&unrouted).await;
        if let Ok(ch) = self.conn.create_channel().await {
            let _ = ch
                .exchange_delete(
                    self.exchange.as_str().into(),
                    ExchangeDeleteOptions::default(),
                )
                .await;
            let _ = ch
                .exchange_delete(unrouted.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        self.pool.close().await;
        if let Ok(mut admin) =
            <sqlx::PgConnection as sqlx::Connection>::connect(&self.admin_url).await
        {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.db_name
            )))
            .execute(&mut admin)
            .await;
        }
    }
}

/// Stops a child with SIGTERM and waits (bounded), then kills it.
pub async fn stop(mut child: Child) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    if tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// Peak and current resident memory of a process, in bytes (VmHWM, VmRSS).
pub fn rss(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// CPU time used per process group (rabbitmq, postgres, relay, other) and by the whole machine,
/// between two snapshots: where the time goes during a scenario.
#[derive(Debug, Clone, Default)]
pub struct CpuSnapshot {
    at: Option<std::time::Instant>,
    machine_busy: u64,
    machine_total: u64,
    groups: std::collections::BTreeMap<String, u64>,
}

const CLK_TCK: f64 = 100.0;

fn group_of(comm: &str) -> &'static str {
    match comm {
        "beam.smp" | "erl_child_setup" | "inet_gethost" | "epmd" => "rabbitmq",
        c if c.starts_with("postgres") || c.starts_with("postmaster") => "postgres",
        "relay" => "relay",
        "consumer" => "consumer",
        // The example application: its API, and its ledger consumer (`producer ledger`).
        "producer" => "producer",
        "bench" => "bench",
        _ => "other",
    }
}

impl CpuSnapshot {
    /// The whole machine only (one read of /proc/stat): enough for [`busy_since`](Self::busy_since).
    pub fn machine() -> Self {
        let mut s = CpuSnapshot {
            at: Some(std::time::Instant::now()),
            ..Default::default()
        };
        if let Ok(stat) = std::fs::read_to_string("/proc/stat")
            && let Some(line) = stat.lines().next()
        {
            let v: Vec<u64> = line
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
            s.machine_total = v.iter().sum();
            s.machine_busy = s.machine_total - idle;
        }
        s
    }

    /// The machine and every process, grouped (rabbitmq, postgres, relay, ...).
    pub fn take() -> Self {
        let mut s = Self::machine();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let name = e.file_name();
                let Some(pid) = name
                    .to_str()
                    .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
                else {
                    continue;
                };
                let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                    continue;
                };
                let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                    continue;
                };
                let comm = &stat[open + 1..close];
                let rest: Vec<&str> = stat[close + 2..].split(' ').collect();
                // utime and stime are fields 14 and 15 (1-based); `rest` starts at field 3.
                let ticks = rest
                    .get(11)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
                    + rest
                        .get(12)
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                *s.groups.entry(group_of(comm).to_string()).or_default() += ticks;
            }
        }
        s
    }

    /// The fraction of the machine's CPU time that was busy between two snapshots.
    pub fn busy_since(&self, earlier: &CpuSnapshot) -> f64 {
        let total = self
            .machine_total
            .saturating_sub(earlier.machine_total)
            .max(1);
        self.machine_busy.saturating_sub(earlier.machine_busy) as f64 / total as f64
    }

    /// CPU milliseconds used by `group` (rabbitmq, postgres, relay, ...) since `earlier`.
    pub fn group_ms_since(&self, earlier: &CpuSnapshot, group: &str) -> f64 {
        let now = self.groups.get(group).copied().unwrap_or(0);
        let before = earlier.groups.get(group).copied().unwrap_or(0);
        now.saturating_sub(before) as f64 / CLK_TCK * 1000.0
    }

    /// "machine 97% busy; cpu ms per 1000 msgs: rabbitmq 80, postgres 40, relay 30".
    pub fn report_since(&self, earlier: &CpuSnapshot, messages: u64) -> String {
        self.report_per(earlier, messages, "msgs")
    }

    /// [`report_since`](Self::report_since) per 1000 of `what`.
    pub fn report_per(&self, earlier: &CpuSnapshot, messages: u64, what: &str) -> String {
        let mut parts = Vec::new();
        for (g, t) in &self.groups {
            let before = earlier.groups.get(g).copied().unwrap_or(0);
            let ms = t.saturating_sub(before) as f64 / CLK_TCK * 1000.0;
            if ms >= 1.0 && g != "other" {
                parts.push(format!("{g} {:.0}", ms * 1000.0 / messages.max(1) as f64));
            }
        }
        let secs = match (self.at, earlier.at) {
            (Some(a), Some(b)) => a.duration_since(b).as_secs_f64(),
            _ => 0.0,
        };
        format!(
            "machine {:.0}% busy over {secs:.1} s; CPU ms per 1000 {what}: {}",
            self.busy_since(earlier) * 100.0,
            parts.join(", ")
        )
    }
}

/// PostgreSQL's CPU by who asked for it: each backend of the bench's database by its session's
/// `application_name` (the relay, a consumer, the bench's producers), background processes by
/// their type. Processes that came and went between two readings (autovacuum workers, sessions
/// of a restarted pool) count in no group: compare with the whole of PostgreSQL to see them.
#[derive(Debug, Clone, Default)]
pub struct PgCpu(std::collections::BTreeMap<i32, (String, u64)>);

impl PgCpu {
    pub async fn take(pool: &PgPool) -> Self {
        let rows: Vec<(i32, String)> = sqlx::query_as(
            "SELECT pid, CASE WHEN backend_type = 'client backend' \
                    THEN coalesce(nullif(application_name, ''), 'unnamed') ELSE backend_type END \
             FROM pg_stat_activity WHERE datname = current_database() OR datname IS NULL",
        )
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        let mut by_pid = std::collections::BTreeMap::new();
        for (pid, who) in rows {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some(close) = stat.rfind(')') else {
                continue;
            };
            let rest: Vec<&str> = stat[close + 2..].split(' ').collect();
            let field = |i: usize| rest.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            by_pid.insert(pid, (who, field(11) + field(12)));
        }
        Self(by_pid)
    }

    /// CPU milliseconds per group since `earlier`, of the processes in both readings, largest
    /// first.
    pub fn ms_since(&self, earlier: &PgCpu) -> Vec<(String, f64)> {
        let mut by: std::collections::BTreeMap<String, f64> = Default::default();
        for (pid, (who, ticks)) in &self.0 {
            if let Some((_, before)) = earlier.0.get(pid) {
                *by.entry(who.clone()).or_default() +=
                    ticks.saturating_sub(*before) as f64 / CLK_TCK * 1000.0;
            }
        }
        let mut v: Vec<(String, f64)> = by.into_iter().collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }
}
