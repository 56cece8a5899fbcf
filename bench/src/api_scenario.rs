//! The example API: POST /orders with new Idempotency-Keys and with replays.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use hdrhistogram::Histogram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// POST /orders through the real producer binary at fixed concurrency: new keys, then replays.
pub(crate) async fn api(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let duration = env.secs(10.0, 1.0);
    let concurrency = 16usize;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let key_out = tokio::process::Command::new(env.bin("producer")?)
        .args(["api-key", "create", "--tenant", "bench"])
        .env("DATABASE_URL", &env.db_url)
        .env("RUST_LOG", "warn")
        .output()
        .await?;
    anyhow::ensure!(key_out.status.success(), "api-key create failed");
    let api_key = String::from_utf8(key_out.stdout)?.trim().to_string();
    let producer = env.spawn("producer", &[], &[("LISTEN_ADDR", &addr.to_string())])?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let base = format!("http://{addr}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .map(|r| r.status().is_success())
        .ok()
        != Some(true)
    {
        anyhow::ensure!(Instant::now() < deadline, "producer not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let body = serde_json::json!({"customer_id": "c-1", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]});
    let mut lines = Vec::new();
    let keys: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    for mode in ["new keys", "replays"] {
        let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
            1, 60_000_000, 3,
        )?));
        let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let started = Instant::now();
        let end = started + duration;
        let mut workers = Vec::new();
        for w in 0..concurrency {
            let (http, base, api_key, body, hist, count, keys) = (
                http.clone(),
                base.clone(),
                api_key.clone(),
                body.clone(),
                hist.clone(),
                count.clone(),
                keys.clone(),
            );
            let replay = mode == "replays";
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
                    let r = http
                        .post(format!("{base}/orders"))
                        .bearer_auth(&api_key)
                        .header("Idempotency-Key", &key)
                        .json(&body)
                        .send()
                        .await?;
                    let status = r.status();
                    let _ = r.bytes().await?;
                    anyhow::ensure!(status.as_u16() == 201, "unexpected status {status}");
                    hist.lock()
                        .unwrap()
                        .record(t.elapsed().as_micros().max(1) as u64)
                        .ok();
                    count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        let n = count.load(std::sync::atomic::Ordering::Relaxed);
        let rate = n as f64 / started.elapsed().as_secs_f64();
        let h = hist.lock().unwrap().clone();
        lines.push(
            Line::new(&format!("api POST /orders {mode}"), rate, "req/s")
                .note(format!("{concurrency} concurrent clients, {n} requests")),
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
