//! The example API: POST /orders with new Idempotency-Keys and with replays.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Clients at once in each mode.
const CONCURRENCY: usize = 16;

/// POST /orders through the real producer binary at fixed concurrency: new keys, then replays.
pub(crate) async fn api(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let duration = env.secs(10.0, 1.0);
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let api_key = create_api_key(env).await?;
    let producer = env.spawn("producer", &[], &[("LISTEN_ADDR", &addr.to_string())])?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(CONCURRENCY)
        .build()?;
    let client = Client {
        http,
        base: format!("http://{addr}"),
        api_key,
    };
    client.wait_ready().await?;

    let mut lines = Vec::new();
    // The keys the "new keys" mode used, for the replays to send again.
    let keys: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    for mode in ["new keys", "replays"] {
        let replay = mode == "replays";
        let (n, rate, h) = post_orders(&client, &keys, replay, duration).await?;
        lines.push(
            Line::new(&format!("api POST /orders {mode}"), rate, "req/s")
                .note(format!("{CONCURRENCY} concurrent clients, {n} requests")),
        );
        lines.push(Line::new(
            &format!("api POST /orders {mode} p99"),
            h.value_at_quantile(0.99) as f64 / 1000.0,
            "ms",
        ));
    }
    env::stop(producer).await;
    Ok(lines)
}

/// An API key of tenant `bench`, made by the producer binary's own CLI.
async fn create_api_key(env: &BenchEnv) -> anyhow::Result<String> {
    let key_out = tokio::process::Command::new(env.bin("producer")?)
        .args(["api-key", "create", "--tenant", "bench"])
        .env("DATABASE_URL", &env.db_url)
        .env("RUST_LOG", "warn")
        .output()
        .await?;
    anyhow::ensure!(key_out.status.success(), "api-key create failed");
    Ok(String::from_utf8(key_out.stdout)?.trim().to_string())
}

/// What every client task needs to call the API.
#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    base: String,
    api_key: String,
}

impl Client {
    /// Waits (up to 60 s) for `/readyz`, so the timed runs do not include the producer's start.
    async fn wait_ready(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self
            .http
            .get(format!("{}/readyz", self.base))
            .send()
            .await
            .map(|r| r.status().is_success())
            .ok()
            != Some(true)
        {
            anyhow::ensure!(Instant::now() < deadline, "producer not ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// One POST /orders with `key`, which must answer 201.
    async fn post_order(&self, key: &str, body: &serde_json::Value) -> anyhow::Result<()> {
        let r = self
            .http
            .post(format!("{}/orders", self.base))
            .bearer_auth(&self.api_key)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await?;
        let status = r.status();
        let _ = r.bytes().await?;
        anyhow::ensure!(status.as_u16() == 201, "unexpected status {status}");
        Ok(())
    }
}

/// [`CONCURRENCY`] clients POSTing orders for `duration`, with new keys (recorded in `keys`) or
/// replaying those keys. Returns (requests, requests/s, latency histogram in microseconds).
async fn post_orders(
    client: &Client,
    keys: &Arc<Mutex<Vec<String>>>,
    replay: bool,
    duration: Duration,
) -> anyhow::Result<(u64, f64, Histogram<u64>)> {
    let body = serde_json::json!({"customer_id": "c-1", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]});
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let count = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let end = started + duration;
    let mut workers = Vec::new();
    for w in 0..CONCURRENCY {
        let (client, body, hist, count, keys) = (
            client.clone(),
            body.clone(),
            hist.clone(),
            count.clone(),
            keys.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut i = 0usize;
            while Instant::now() < end {
                let key = if replay {
                    let k = keys.lock().unwrap();
                    anyhow::ensure!(!k.is_empty(), "no keys to replay");
                    k[(w * 7919 + i) % k.len()].clone()
                } else {
                    uuid::Uuid::new_v4().to_string()
                };
                let t = Instant::now();
                client.post_order(&key, &body).await?;
                hist.lock()
                    .unwrap()
                    .record(t.elapsed().as_micros().max(1) as u64)
                    .ok();
                count.fetch_add(1, Ordering::Relaxed);
                if !replay {
                    keys.lock().unwrap().push(key);
                }
                i += 1;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let n = count.load(Ordering::Relaxed);
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let h = hist.lock().unwrap().clone();
    Ok((n, rate, h))
}
