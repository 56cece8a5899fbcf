//! The alert rules of `deploy/prometheus/rules/outbox.yml` in a real Prometheus that scrapes a
//! real relay (a child process) whose RabbitMQ link is cut and restored.
//!
//! The rules file is used as deployed, thresholds and expressions included; the only change, made
//! in a copy, shortens every `for:` to a few seconds (the deployed values are minutes). The
//! outbox rows are backdated by an hour, as if the link had been down that long, so the real
//! 60 s and 10 min age thresholds are crossed at once. The generated Prometheus configuration
//! scrapes and evaluates every second.
//!
//! Needs the `prometheus` binary (Debian package `prometheus`; `.ci/run` installs it), found on
//! PATH or through `PROMETHEUS_BIN`. Without it the test fails: it never skips.

use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use system_tests::relays::{FAST_FLAGS, spawn_relay};
use system_tests::*;

/// The deployed rules file.
const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/prometheus/rules/outbox.yml"
);

/// What every `for:` of the rules becomes in the test's copy.
const SHORT_FOR: &str = "2s";

/// An active alert as `/api/v1/alerts` reports it.
#[derive(Debug, Clone, Deserialize)]
struct Alert {
    labels: HashMap<String, String>,
    annotations: HashMap<String, String>,
    state: String,
    value: String,
}

impl Alert {
    fn name(&self) -> &str {
        self.labels
            .get("alertname")
            .map(String::as_str)
            .unwrap_or("")
    }
}

/// The `prometheus` binary: `PROMETHEUS_BIN`, or the first `prometheus` on PATH.
fn prometheus_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("PROMETHEUS_BIN") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "PROMETHEUS_BIN={} is not a file", p.display());
        return p;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("prometheus"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "the `prometheus` binary is not installed, and this test needs a real Prometheus: \
                 install it with `apt-get install -y prometheus` (.ci/run does) or point \
                 PROMETHEUS_BIN at one"
            )
        })
}

/// The rules file with every `for:` duration replaced by `short`. Fails if the file has an alert
/// without a `for:` line of its own (the rewrite would silently test something else).
fn rules_with_short_for(rules: &str, short: &str) -> String {
    let alerts = rules
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    let mut rewritten = 0;
    let mut out = String::with_capacity(rules.len());
    for line in rules.lines() {
        let body = line.trim_start();
        if body.starts_with("for:") {
            let indent = &line[..line.len() - body.len()];
            out.push_str(&format!("{indent}for: {short}"));
            rewritten += 1;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    assert!(alerts > 0, "no alert in {RULES}");
    assert_eq!(
        rewritten, alerts,
        "every alert in {RULES} must have one `for:` line (found {rewritten} for {alerts} alerts)"
    );
    out
}

/// A Prometheus server on a free port with its own storage, killed and removed when dropped.
struct Prometheus {
    child: std::process::Child,
    url: String,
    dir: PathBuf,
    http: reqwest::Client,
}

impl Prometheus {
    async fn start(relay_metrics: SocketAddr) -> Self {
        let binary = prometheus_binary();
        let dir = std::env::temp_dir().join(unique("prometheus"));
        std::fs::create_dir_all(dir.join("data")).expect("create Prometheus temp dir");
        let rules = std::fs::read_to_string(RULES)
            .unwrap_or_else(|e| panic!("read the rules file {RULES}: {e}"));
        let rules_copy = dir.join("rules.yml");
        std::fs::write(&rules_copy, rules_with_short_for(&rules, SHORT_FOR)).unwrap();
        // Job name `relay`, as in deploy/prometheus/prometheus.yml: the rules select on it.
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: relay\n    static_configs:\n      - targets: [\"{relay_metrics}\"]\n",
            rules = rules_copy.display(),
        );
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let addr = free_addr();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = std::process::Command::new(&binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--storage.tsdb.retention.time=1h")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        let prometheus = Self {
            child,
            url: format!("http://{addr}"),
            dir,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap(),
        };
        let ready = format!("{}/-/ready", prometheus.url);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = prometheus.http.get(&ready).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Prometheus not ready after 30 s\n{}",
                prometheus.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        prometheus
    }

    async fn api(&self, path: &str) -> Value {
        let url = format!("{}{path}", self.url);
        let body: Value = self
            .http
            .get(&url)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}\n{}", self.log_tail()))
            .json()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: not JSON: {e}"));
        assert_eq!(body["status"], "success", "GET {url}: {body}");
        body["data"].clone()
    }

    /// Active (pending and firing) alerts.
    async fn alerts(&self) -> Vec<Alert> {
        serde_json::from_value(self.api("/api/v1/alerts").await["alerts"].clone())
            .expect("alerts in the shape of the v1 API")
    }

    /// Values of an instant query, by their `instance` label.
    async fn query(&self, promql: &str) -> Vec<f64> {
        let q: String = url_encode(promql);
        let data = self.api(&format!("/api/v1/query?query={q}")).await;
        data["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["value"][1].as_str().unwrap().parse().unwrap())
            .collect()
    }

    /// Waits until `check` holds for the active alerts; panics with them and the server log.
    async fn wait_for_alerts(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&[Alert]) -> bool,
    ) -> Vec<Alert> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let alerts = self.alerts().await;
            if check(&alerts) {
                return alerts;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}; active alerts: {}\n{}",
                    describe(&alerts),
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        format!(
            "--- Prometheus log (last lines) ---\n{}",
            lines[lines.len().saturating_sub(30)..].join("\n")
        )
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn describe(alerts: &[Alert]) -> String {
    let v: Vec<String> = alerts
        .iter()
        .map(|a| format!("{}={} ({})", a.name(), a.state, a.value))
        .collect();
    format!("[{}]", v.join(", "))
}

fn find<'a>(alerts: &'a [Alert], name: &str) -> Option<&'a Alert> {
    alerts.iter().find(|a| a.name() == name)
}

fn firing(alerts: &[Alert], name: &str) -> bool {
    find(alerts, name).is_some_and(|a| a.state == "firing")
}

async fn relay_ready(http: &reqwest::Client, metrics: SocketAddr) -> bool {
    http.get(format!("http://{metrics}/readyz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

#[test]
fn the_for_rewrite_touches_every_alert_and_nothing_else() {
    let rules = std::fs::read_to_string(RULES).unwrap();
    let short = rules_with_short_for(&rules, SHORT_FOR);
    assert_eq!(short.lines().count(), rules.lines().count());
    for (a, b) in rules.lines().zip(short.lines()) {
        if a.trim_start().starts_with("for:") {
            assert!(b.trim_start() == format!("for: {SHORT_FOR}"), "{b}");
        } else {
            assert_eq!(a, b);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_alerts_fire_while_the_broker_link_is_cut_and_resolve_when_it_is_back() {
    prometheus_binary(); // fail fast, before any setup, when it is missing
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let exchange = broker.exchange("alerts");
    broker.track_exchange(&plumbing::amqp::unrouted_name(&exchange));
    broker.track_queue(&plumbing::amqp::unrouted_name(&exchange));
    let proxy = TcpProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let amqp_via_proxy = amqp_url().replace("127.0.0.1:5672", &proxy.addr.to_string());
    let metrics = free_addr();
    let _relay = spawn_relay(&db.url, &amqp_via_proxy, &exchange, metrics, &FAST_FLAGS);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    wait_until(
        "relay ready (connected to PostgreSQL and RabbitMQ)",
        Duration::from_secs(30),
        || async { relay_ready(&http, metrics).await.then_some(()) },
    )
    .await;

    let prometheus = Prometheus::start(metrics).await;
    // Scraped under the job name the rules use, and ready.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while prometheus
        .query("relay_ready{job=\"relay\"} == 1")
        .await
        .len()
        != 1
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "Prometheus never scraped relay_ready 1 from the relay at {metrics}\n{}",
            prometheus.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Healthy: no outbox or relay alert (several evaluations, each longer than the short `for:`).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let alerts = prometheus.alerts().await;
    for name in [
        "OutboxOldestPendingAgeHigh",
        "OutboxOldestPendingAgeCritical",
        "OutboxDeadMessages",
        "RelayDown",
        "RelaysAllDown",
        "RelayNotReady",
    ] {
        assert!(
            find(&alerts, name).is_none(),
            "{name} active while everything is healthy: {}",
            describe(&alerts)
        );
    }

    // Cut the broker link, then write rows that cannot be published, aged as if the link had
    // been down for an hour.
    proxy.set_mode(ProxyMode::Down);
    wait_until(
        "relay reports not ready",
        Duration::from_secs(30),
        || async { (!relay_ready(&http, metrics).await).then_some(()) },
    )
    .await;
    let msgs = spread("test", "thing.happened", "agg-", 10, 0..50);
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue_many(&mut *tx, &msgs).await.unwrap();
    sqlx::query("UPDATE outbox.messages SET created_at = now() - interval '1 hour'")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let alerts = prometheus
        .wait_for_alerts(
            "the oldest-age alerts and RelayNotReady firing",
            Duration::from_secs(60),
            |a| {
                firing(a, "OutboxOldestPendingAgeHigh")
                    && firing(a, "OutboxOldestPendingAgeCritical")
                    && firing(a, "RelayNotReady")
            },
        )
        .await;
    let high = find(&alerts, "OutboxOldestPendingAgeHigh").unwrap();
    assert_eq!(high.labels["severity"], "warning");
    let age: f64 = high.value.parse().expect("alert value is a number");
    assert!(age >= 3600.0, "oldest age {age} s, rows are an hour old");
    assert!(
        high.annotations["summary"].starts_with("Oldest pending outbox row is 1h"),
        "summary: {}",
        high.annotations["summary"]
    );
    assert_eq!(
        high.annotations["runbook_url"],
        "docs/operations.md#outboxoldestpendingagehigh"
    );
    assert_eq!(
        find(&alerts, "OutboxOldestPendingAgeCritical")
            .unwrap()
            .labels["severity"],
        "critical"
    );
    let not_ready = find(&alerts, "RelayNotReady").unwrap();
    assert_eq!(not_ready.labels["job"], "relay");
    assert_eq!(not_ready.labels["instance"], metrics.to_string());
    // A cut link is not charged to the messages (no dead rows), and the relay is still scraped.
    for name in ["OutboxDeadMessages", "RelayDown", "RelaysAllDown"] {
        assert!(
            find(&alerts, name).is_none(),
            "{name} active while only the broker link is cut: {}",
            describe(&alerts)
        );
    }
    // Every rule of the file evaluates without error against the real metrics.
    let groups = prometheus.api("/api/v1/rules").await["groups"].clone();
    let mut rules = 0;
    for group in groups.as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            rules += 1;
            assert_ne!(
                rule["health"], "err",
                "rule {} fails to evaluate: {}",
                rule["name"], rule["lastError"]
            );
        }
    }
    let deployed = std::fs::read_to_string(RULES).unwrap();
    let expected = deployed
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            t.starts_with("- alert:") || t.starts_with("- record:")
        })
        .count();
    assert_eq!(rules, expected, "Prometheus loaded every rule of {RULES}");

    // The link is back: the rows go out and the alerts resolve.
    proxy.set_mode(ProxyMode::Pass);
    wait_no_pending(&db.pool, Duration::from_secs(60)).await;
    prometheus
        .wait_for_alerts(
            "the oldest-age alerts and RelayNotReady resolved",
            Duration::from_secs(60),
            |a| {
                find(a, "OutboxOldestPendingAgeHigh").is_none()
                    && find(a, "OutboxOldestPendingAgeCritical").is_none()
                    && find(a, "RelayNotReady").is_none()
            },
        )
        .await;
}
