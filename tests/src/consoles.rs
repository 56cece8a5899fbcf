//! A console in the test's own process, and an HTTP client for its API and web pages that follows
//! no redirect (a test reads every answer as it comes).

use crate::amqp_url;
use console::ServeConfig;
use console::config::DbConfig;
use shared::schema::Schema;
use tokio_util::sync::CancellationToken;

/// The console's settings for a test on `database_url` that browses `consumers`
/// (CONSOLE_CONSUMERS): any free port, sessions of an hour, no secure cookies, a year of audit,
/// ordered gaps stuck after a minute, 5 failed logins a minute, `customer_secret` declared secret.
pub fn test_config(database_url: &str, consumers: &[&str]) -> ServeConfig {
    ServeConfig {
        db: DbConfig {
            database_url: database_url.to_string(),
            schema: Schema::default(),
        },
        amqp_url: amqp_url(),
        amqp_tls: Default::default(),
        addr: "127.0.0.1:0".parse().unwrap(),
        consumers: consumers.iter().map(|c| c.to_string()).collect(),
        session_ttl_seconds: 3600,
        session_idle_seconds: 1800,
        cookie_secure: false,
        audit_retention_days: 365,
        ordered_gap_seconds: 60,
        login_attempts_per_minute: 5,
        secret_fields: vec!["customer_secret".into()],
        look: Default::default(),
    }
}

/// A started console (stopped when dropped) and a client for it.
pub struct RunningConsole {
    /// `http://<addr>`, where the console listens.
    pub base: String,
    /// A client that follows no redirect.
    pub http: reqwest::Client,
    shutdown: CancellationToken,
}

impl Drop for RunningConsole {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl RunningConsole {
    pub async fn start(config: ServeConfig) -> Self {
        let shutdown = CancellationToken::new();
        let running = console::start(config, shutdown.clone())
            .await
            .expect("console starts");
        Self {
            base: format!("http://{}", running.addr),
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            shutdown,
        }
    }

    /// An API GET with bearer `token`, whatever the answer.
    pub async fn api_get(&self, token: &str, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.base))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
    }

    /// An API POST of JSON `body` with bearer `token` and, when given, Idempotency-Key `key`,
    /// whatever the answer.
    pub async fn api_post(
        &self,
        token: &str,
        path: &str,
        body: &serde_json::Value,
        key: Option<&str>,
    ) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
            .json(body);
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        req.send().await.unwrap()
    }

    /// The login form sent with `token`, whatever the answer.
    pub async fn login_with(&self, token: &str) -> reqwest::Response {
        self.http
            .post(format!("{}/login", self.base))
            .form(&[("token", token)])
            .send()
            .await
            .unwrap()
    }

    /// A web page (GET) in the session of `cookie`.
    pub async fn web_get(&self, cookie: &str, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.base))
            .header("cookie", cookie)
            .send()
            .await
            .unwrap()
    }

    /// A web form (POST, form-encoded `form`) in the session of `cookie`.
    pub async fn web_post<F: serde::Serialize + ?Sized>(
        &self,
        cookie: &str,
        path: &str,
        form: &F,
    ) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.base))
            .header("cookie", cookie)
            .form(form)
            .send()
            .await
            .unwrap()
    }

    /// A GET without any credentials (metrics, health, a page before logging in).
    pub async fn anonymous_get(&self, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
    }
}

/// The `console_session=…` (or `__Host-console_session=…`) Set-Cookie header of `r` (with its
/// attributes), if it sets one.
pub fn session_cookie(r: &reqwest::Response) -> Option<String> {
    r.headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("console_session=") || v.starts_with("__Host-console_session="))
        .map(str::to_string)
}

/// The status of console approval `id` (`pending`, `approved`, `superseded`, …).
pub async fn approval_status(pool: &sqlx::PgPool, id: &str) -> String {
    sqlx::query_scalar("SELECT status FROM outbox.console_approvals WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}
