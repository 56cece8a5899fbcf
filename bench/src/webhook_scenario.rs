//! `webhook-ingest`: the webhook receiver (`idempotency::webhooks`) mounted on an axum server in
//! the bench process, fed signed `charge.*` events over HTTP: signature check, inbox row and a
//! one-row handler effect in one transaction, then the 200. Over one connection (sequential) and
//! over many; the ceiling is the same database work without HTTP or signature (the inbox row and
//! the effect in one transaction per event) at the same concurrency, in the same run.

use crate::env::BenchEnv;
use crate::report::Line;
use hdrhistogram::Histogram;
use idempotency::webhooks::{HandlerError, ObjectVersion, WebhookEvent, WebhookHandler, sign};
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const SECRET: &[u8] = b"bench-webhook-secret";
const MANY: usize = 32;

/// The service's effect: one row per charge event, in the inbox row's transaction; events order
/// by their type's rank within a charge, as the demo's payments do.
struct Effects;

impl WebhookHandler for Effects {
    fn version(&self, e: &WebhookEvent) -> Option<ObjectVersion> {
        let rank = match e.kind.as_str() {
            "charge.refunded" => 3,
            "charge.succeeded" | "charge.failed" => 2,
            _ => 1,
        };
        Some(ObjectVersion {
            object: e.object_id.clone()?,
            position: rank,
        })
    }

    async fn handle(&self, tx: &mut PgConnection, e: &WebhookEvent) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO bench_webhook_effects (event_id, kind) VALUES ($1, $2)")
            .bind(&e.id)
            .bind(&e.kind)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

fn event(run: &str, n: u64) -> (String, String) {
    let body = json!({
        "id": format!("evt_{run}_{n}"),
        "type": "charge.succeeded",
        "created": chrono::Utc::now().timestamp(),
        "data": {"object": {"id": format!("ch_{run}_{n}"), "amount": 1999, "currency": "EUR"}},
    })
    .to_string();
    let header = sign(SECRET, chrono::Utc::now().timestamp(), body.as_bytes());
    (body, header)
}

/// Sends `n` events from `tasks` concurrent clients (one keep-alive connection each); returns the
/// rate and the latency histogram (µs).
async fn drive(
    url: &str,
    run: &str,
    n: u64,
    tasks: usize,
) -> anyhow::Result<(f64, Histogram<u64>)> {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (next, url, run) = (next.clone(), url.to_string(), run.to_string());
        handles.push(tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .build()?;
            let mut h = Histogram::<u64>::new(3)?;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let (body, signature) = event(&run, i);
                let t = Instant::now();
                let r = http
                    .post(&url)
                    .header("Provider-Signature", signature)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await?;
                anyhow::ensure!(r.status().is_success(), "webhook answered {}", r.status());
                h.record(t.elapsed().as_micros() as u64)?;
            }
            anyhow::Ok(h)
        }));
    }
    let mut all = Histogram::<u64>::new(3)?;
    for h in handles {
        all.add(h.await??)?;
    }
    Ok((n as f64 / started.elapsed().as_secs_f64(), all))
}

/// The same rows without HTTP or signature: one transaction per event (inbox row, effect).
async fn ceiling(pool: &PgPool, run: &str, n: u64, tasks: usize) -> anyhow::Result<f64> {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (next, pool, run) = (next.clone(), pool.clone(), run.to_string());
        handles.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let (body, _) = event(&run, i);
                let mut tx = pool.begin().await?;
                sqlx::query(
                    "INSERT INTO outbox.webhook_inbox (source, event_id, event_type, object_key, position, outcome, signed_at, payload) \
                     VALUES ('ceiling', $1, 'charge.succeeded', $2, 2, 'applied', now(), $3) ON CONFLICT DO NOTHING",
                )
                .bind(format!("evt_{run}_{i}"))
                .bind(format!("ch_{run}_{i}"))
                .bind(&body)
                .execute(&mut *tx)
                .await?;
                sqlx::query("INSERT INTO bench_webhook_effects (event_id, kind) VALUES ($1, 'charge.succeeded')")
                    .bind(format!("c_{run}_{i}"))
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for h in handles {
        h.await??;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

pub async fn webhook_ingest(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_webhook_effects (event_id text PRIMARY KEY, kind text NOT NULL)",
    )
    .execute(&env.pool)
    .await?;
    let pool =
        plumbing::db::connect(&env.db_url, MANY as u32 + 2, "bench webhook receiver").await?;
    let receiver =
        idempotency::webhooks::WebhookReceiver::new(pool.clone(), "provider", SECRET, Effects);
    let app = axum::Router::new().route("/webhooks/provider", receiver.into_route());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/webhooks/provider", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let mut lines = Vec::new();
    for (tasks, n) in [(1usize, env.n(3_000, 50)), (MANY, env.n(20_000, 200))] {
        let run = format!("{}c{tasks}", uuid::Uuid::new_v4().simple());
        let roof = ceiling(&pool, &format!("{run}r"), n, tasks).await?;
        let (rate, h) = drive(&url, &run, n, tasks).await?;
        let applied: i64 =
            sqlx::query_scalar("SELECT count(*) FROM bench_webhook_effects WHERE event_id LIKE $1")
                .bind(format!("evt_{run}_%"))
                .fetch_one(&env.pool)
                .await?;
        anyhow::ensure!(
            applied as u64 == n,
            "{applied} of {n} webhook effects applied"
        );
        let label = if tasks == 1 {
            "1 connection"
        } else {
            "32 connections"
        };
        lines.push(
            Line::new(&format!("webhook ingest ({label})"), rate, "events/s")
                .vs_ceiling(roof, None)
                .note(format!(
                    "{n} signed charge events over HTTP: verify (HMAC-SHA256, constant time), inbox row, ordering row, a one-row effect, commit, 200; latency p50 {:.2} ms, p99 {:.2} ms; ceiling = the inbox row and the effect in one transaction per event without HTTP or signature, same concurrency",
                    h.value_at_quantile(0.5) as f64 / 1000.0,
                    h.value_at_quantile(0.99) as f64 / 1000.0,
                )),
        );
    }
    server.abort();
    pool.close().await;
    Ok(lines)
}
