//! Web sessions: logging in with a token gives a session cookie (HttpOnly, SameSite=Strict,
//! Secure when configured, with an expiry) and a CSRF token every form POST must carry. Failed
//! logins are limited per client address.

use crate::auth::users::{self, Principal};
use crate::error::ConsoleError;
use shared::schema::Schema;
use sqlx::PgPool;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The cookie's name over plain HTTP (development, tests).
pub const COOKIE: &str = "console_session";
/// The cookie's name when it is `Secure` (`CONSOLE_COOKIE_SECURE=true`): the `__Host-` prefix makes
/// the browser take it only from this host over HTTPS, with `Path=/` and no `Domain`, so neither
/// a sibling subdomain nor a plain-HTTP response can set or shadow it.
pub const SECURE_COOKIE: &str = "__Host-console_session";

/// The cookie's name for the console's setting.
pub fn cookie_name(secure: bool) -> &'static str {
    if secure { SECURE_COOKIE } else { COOKIE }
}

/// A logged-in session.
#[derive(Debug, Clone)]
pub struct Session {
    pub principal: Principal,
    pub csrf: String,
}

/// Creates a session for `principal`; returns the cookie value.
pub async fn create(
    pool: &PgPool,
    schema: &Schema,
    principal: &Principal,
    ttl: Duration,
) -> Result<(String, String), ConsoleError> {
    let id = users::new_secret();
    let csrf = hex::encode(users::hash(&users::new_secret()));
    let mut tx = pool.begin().await?;
    sqlx::query(schema.sql("DELETE FROM {{schema}}.console_sessions WHERE expires_at < now()"))
        .execute(&mut *tx)
        .await?;
    sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.console_sessions (token_hash, user_id, csrf_token, expires_at) \
         VALUES ($1, $2, $3, now() + make_interval(secs => $4))",
    ))
    .bind(users::hash(&id))
    .bind(principal.id)
    .bind(&csrf)
    .bind(ttl.as_secs_f64())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((id, csrf))
}

/// How stale a session's `last_seen_at` may be before a page writes it again: the idle clock
/// moves in these steps, so a console refreshing every few seconds writes its session row twice
/// a minute, not at every page.
const SEEN_EVERY_SECONDS: f64 = 30.0;

/// The live session with cookie value `id`, used now: not past its lifetime, not unused for
/// `idle` or longer, of a user not revoked (others give none). Using it moves its idle clock.
pub async fn find(
    pool: &PgPool,
    schema: &Schema,
    id: &str,
    idle: Duration,
) -> Result<Option<Session>, ConsoleError> {
    let hash = users::hash(id);
    let row: Option<(Uuid, String, String, String, bool)> = sqlx::query_as(schema.sql(
        "SELECT u.id, u.name, u.role, s.csrf_token, \
                s.last_seen_at < now() - make_interval(secs => $3) AS stale \
         FROM {{schema}}.console_sessions s \
         JOIN {{schema}}.console_users u ON u.id = s.user_id \
         WHERE s.token_hash = $1 AND s.expires_at > now() \
           AND s.last_seen_at > now() - make_interval(secs => $2) AND u.revoked_at IS NULL",
    ))
    .bind(&hash)
    .bind(idle.as_secs_f64())
    .bind(SEEN_EVERY_SECONDS)
    .fetch_optional(pool)
    .await?;
    let Some((user, name, role, csrf, stale)) = row else {
        return Ok(None);
    };
    if stale {
        sqlx::query(schema.sql(
            "UPDATE {{schema}}.console_sessions SET last_seen_at = now() WHERE token_hash = $1",
        ))
        .bind(&hash)
        .execute(pool)
        .await?;
    }
    Ok(role.parse().ok().map(|role| Session {
        principal: Principal {
            id: user,
            name,
            role,
        },
        csrf,
    }))
}

/// Ends a session.
pub async fn delete(pool: &PgPool, schema: &Schema, id: &str) -> Result<(), ConsoleError> {
    sqlx::query(schema.sql("DELETE FROM {{schema}}.console_sessions WHERE token_hash = $1"))
        .bind(users::hash(id))
        .execute(pool)
        .await?;
    Ok(())
}

/// The `Set-Cookie` value for a new session.
pub fn set_cookie(id: &str, ttl: Duration, secure: bool) -> String {
    format!(
        "{}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{}",
        cookie_name(secure),
        ttl.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// The `Set-Cookie` value that removes the cookie.
pub fn clear_cookie(secure: bool) -> String {
    format!(
        "{}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{}",
        cookie_name(secure),
        if secure { "; Secure" } else { "" }
    )
}

/// The session cookie's value in a `Cookie` header: only the name the setting gives (a secure
/// console never reads the plain name, which anyone on the path could have set).
pub fn cookie_value(headers: &axum::http::HeaderMap, secure: bool) -> Option<String> {
    let name = cookie_name(secure);
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, value)| value.to_string())
        .filter(|v| !v.is_empty())
}

/// Failed logins per client address: at most `max` within `window`, then 429 until the window
/// of the oldest counted failure has passed.
#[derive(Debug)]
pub struct LoginLimiter {
    max: usize,
    window: Duration,
    failures: Mutex<HashMap<IpAddr, Vec<Instant>>>,
}

impl LoginLimiter {
    pub fn new(max: usize, window: Duration) -> Self {
        Self {
            max,
            window,
            failures: Mutex::new(HashMap::new()),
        }
    }

    fn recent(&self, map: &mut HashMap<IpAddr, Vec<Instant>>, addr: IpAddr) -> usize {
        let now = Instant::now();
        let list = map.entry(addr).or_default();
        list.retain(|t| now.duration_since(*t) < self.window);
        list.len()
    }

    /// Whether `addr` may try now.
    pub fn may_try(&self, addr: IpAddr) -> bool {
        let mut map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        self.recent(&mut map, addr) < self.max
    }

    /// Records a failed attempt.
    pub fn failed(&self, addr: IpAddr) {
        let mut map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        self.recent(&mut map, addr);
        map.entry(addr).or_default().push(Instant::now());
        // Bound memory: forget addresses with nothing recent.
        if map.len() > 10_000 {
            let window = self.window;
            let now = Instant::now();
            map.retain(|_, l| l.iter().any(|t| now.duration_since(*t) < window));
        }
    }
}
