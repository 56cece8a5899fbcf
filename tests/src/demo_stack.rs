//! The example application's payment stack for the tests that pay: the payment provider simulator
//! as a child process and the demo API in the test process, on one test database.

use crate::{TestDb, bin_path, free_addr, wait_http_ok};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// The `PROVIDER_*` settings a test may give; none of them is inherited from the environment.
const PROVIDER_SETTINGS: [&str; 16] = [
    "PROVIDER_FAULTS",
    "PROVIDER_MODE",
    "PROVIDER_WEBHOOK_URL",
    "PROVIDER_WEBHOOK_SECRET",
    "PROVIDER_CONFIRM_DELAY",
    "PROVIDER_WEBHOOK_MAX_ATTEMPTS",
    "PROVIDER_WEBHOOK_BACKOFF",
    "PROVIDER_WEBHOOK_BACKOFF_MAX",
    "PROVIDER_WEBHOOK_DELAY",
    "PROVIDER_WEBHOOK_REORDER_WINDOW",
    "PROVIDER_WEBHOOK_TIMEOUT",
    "PROVIDER_IDEMPOTENCY",
    "PROVIDER_STATUS_QUERY",
    "PROVIDER_SEED",
    "PROVIDER_TIMEOUT_DELAY",
    "PROVIDER_SLOW_DELAY",
];

/// Starts `payment-provider` on `db` with `env` (`PROVIDER_*`, nothing else inherited) and waits
/// until it answers; returns the child (killed when dropped) and its base URL.
pub async fn spawn_provider(db: &TestDb, env: &[(&str, &str)]) -> (Child, String) {
    let addr = free_addr();
    let mut cmd = Command::new(bin_path("payment-provider"));
    for var in PROVIDER_SETTINGS {
        cmd.env_remove(var);
    }
    let child = cmd
        .env("DATABASE_URL", &db.url)
        .env("PROVIDER_ADDR", addr.to_string())
        .env("PROVIDER_DB_MAX_CONNECTIONS", "6")
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn payment-provider (cargo build --bins)");
    wait_http_ok(
        "the provider answers /healthz",
        addr,
        "/healthz",
        Duration::from_secs(90),
    )
    .await;
    (child, format!("http://{addr}"))
}

/// A `producer worker` child process named `name` on `db`, charging through the provider at
/// `provider_url` with payment remote `remote`: 2 s leases, 400 ms heartbeats, 200 ms polls, a
/// 1 s provider call timeout, warnings only, no trace export, stdout dropped, killed when
/// dropped. The test adds its charge retry settings (and any other), then spawns it.
pub fn worker_command(db: &TestDb, provider_url: &str, remote: &str, name: &str) -> Command {
    let mut cmd = Command::new(bin_path("producer"));
    cmd.arg("worker")
        .env("DATABASE_URL", &db.url)
        .env("PROVIDER_URL", provider_url)
        .env("PAYMENT_REMOTE", remote)
        .env("METRICS_ADDR", free_addr().to_string())
        .env("WORKER_ID", name)
        .env("WORKER_LEASE_MS", "2000")
        .env("WORKER_HEARTBEAT_MS", "400")
        .env("WORKER_POLL_MS", "200")
        .env("PROVIDER_CALL_TIMEOUT_MS", "1000")
        .env("RUST_LOG", "warn")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    cmd
}

/// The demo API in this process on `db`, its payments against `remote`, until `shutdown`;
/// returns its base URL and an API key of tenant `acme`.
pub async fn start_api(
    db: &TestDb,
    remote: processes::Remote,
    shutdown: CancellationToken,
) -> (String, String) {
    start_api_with(db, remote, None, shutdown).await
}

/// [`start_api`], receiving the provider's webhooks at `POST /webhooks/provider` when
/// `webhook_secret` is given.
pub async fn start_api_with(
    db: &TestDb,
    remote: processes::Remote,
    webhook_secret: Option<&str>,
    shutdown: CancellationToken,
) -> (String, String) {
    let settings = demo::Settings {
        purge_interval: None,
        payment_remote: remote,
        provider_webhook_secret: webhook_secret
            .map(|s| demo::provider_webhooks::WebhookSecret(s.to_string())),
        ..demo::Settings::default()
    };
    let server = demo::start(
        demo::AppState::new(db.pool.clone(), settings),
        "127.0.0.1:0".parse().unwrap(),
        shutdown,
    )
    .await
    .expect("the demo API starts");
    let key = demo::auth::create_api_key(&db.pool, "acme")
        .await
        .expect("create an API key");
    (format!("http://{}", server.local_addr()), key)
}

/// Support cancels order `order` (the demo's row, as its back office would).
pub async fn cancel_order(db: &TestDb, order: uuid::Uuid) {
    sqlx::query("UPDATE demo.orders SET status = 'cancelled' WHERE id = $1")
        .bind(order)
        .execute(&db.pool)
        .await
        .unwrap();
}

/// A client of the demo API at `base` as the tenant of API key `key`, each request limited to 30 s.
pub struct ApiClient {
    pub base: String,
    key: String,
    http: reqwest::Client,
}

impl ApiClient {
    pub fn new(base: String, key: String) -> Self {
        Self {
            base,
            key,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        }
    }

    /// POSTs JSON text `body` to `path` with Idempotency-Key `idempotency_key` and the extra
    /// `headers`; the answer, whatever it is.
    pub async fn post(
        &self,
        path: &str,
        idempotency_key: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.key)
            .header("Idempotency-Key", idempotency_key)
            .header("content-type", "application/json");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(body.to_string())
            .send()
            .await
            .expect("HTTP request")
    }

    /// [`Self::post`] as a well-behaved client sends it: a 503 (the API's pool had no connection
    /// for it, which a suite loading the machine can cause) is sent again with the same key after
    /// its `Retry-After`, for up to a minute. The key makes that safe; any other answer is returned.
    pub async fn post_retrying_unavailable(
        &self,
        path: &str,
        idempotency_key: &str,
        body: &str,
    ) -> reqwest::Response {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let r = self.post(path, idempotency_key, body, &[]).await;
            if r.status() != reqwest::StatusCode::SERVICE_UNAVAILABLE
                || std::time::Instant::now() > deadline
            {
                return r;
            }
            let wait = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                .unwrap_or(1);
            tokio::time::sleep(Duration::from_secs(wait.clamp(1, 5))).await;
        }
    }
}
