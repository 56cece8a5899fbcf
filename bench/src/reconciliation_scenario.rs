//! `reconciliation`: one run of the demo's reconciliation job (`demo::reconciliation::run_once`)
//! over 10,000 and then 100,000 settled payments, against the payment provider simulator (its
//! own process, in sync mode) holding a charge for every payment but one in a hundred (which the
//! run must report as `recorded_not_charged`). The ceiling is the provider lookups alone: the
//! same `GET /charges?reference=` calls in the same order, without the database.

use crate::env::{self, BenchEnv};
use crate::report::Line;
use demo::reconciliation::{ReconcileConfig, run_once};
use payment_provider::client::Client;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Every hundredth payment has no charge at the provider.
const MISSING_EVERY: usize = 100;

/// Adds `n` settled payments (succeeded two minutes ago, 10.00 EUR) with their orders; returns
/// their ids.
async fn seed_payments(env: &BenchEnv, n: usize) -> anyhow::Result<Vec<Uuid>> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
    for chunk in ids.chunks(10_000) {
        let orders: Vec<Uuid> = chunk.iter().map(|_| Uuid::now_v7()).collect();
        let mut tx = env.pool.begin().await?;
        sqlx::query(
            "INSERT INTO demo.orders (id, tenant, customer_id, currency, total_amount, status, created_at) \
             SELECT o, 'bench', 'c', 'EUR', 1000, 'paid', now() - interval '2 minutes' FROM unnest($1::uuid[]) o",
        )
        .bind(&orders)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO demo.payments (id, tenant, order_id, amount, currency, status, created_at, updated_at) \
             SELECT p, 'bench', o, 1000, 'EUR', 'succeeded', now() - interval '2 minutes', now() \
             FROM unnest($1::uuid[], $2::uuid[]) AS t(p, o)",
        )
        .bind(chunk)
        .bind(&orders)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
    }
    Ok(ids)
}

/// Charges every payment but every hundredth at the provider, 16 requests at a time.
async fn seed_charges(provider: &Client, ids: &[Uuid]) -> anyhow::Result<()> {
    let ids: Arc<Vec<Uuid>> = Arc::new(ids.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (ids, next, provider) = (ids.clone(), next.clone(), provider.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(id) = ids.get(i) else { break };
                if i % MISSING_EVERY == MISSING_EVERY - 1 {
                    continue;
                }
                let key = id.to_string();
                provider
                    .charge(&key, 1000, "EUR", Some(&key))
                    .await
                    .map_err(|e| anyhow::anyhow!("charge {key}: {e}"))?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

pub async fn reconciliation(env: &BenchEnv) -> anyhow::Result<Vec<Line>> {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let provider_process = env.spawn(
        "payment-provider",
        &[],
        &[
            ("PROVIDER_ADDR", &addr.to_string()),
            ("PROVIDER_MODE", "sync"),
        ],
    )?;
    let provider = Client::new(&format!("http://{addr}"), Duration::from_secs(30))?;
    let up = Instant::now() + Duration::from_secs(60);
    while provider.charges_by_reference("probe").await.is_err() {
        anyhow::ensure!(
            Instant::now() < up,
            "the provider simulator did not start in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::query("DELETE FROM demo.reconciliation_cases")
        .execute(&env.pool)
        .await?;
    let cfg = ReconcileConfig {
        settle: Duration::from_secs(1),
        ..ReconcileConfig::default()
    };
    let mut lines = Vec::new();
    let mut all: Vec<Uuid> = Vec::new();
    for total in [env.n(10_000, 100) as usize, env.n(100_000, 300) as usize] {
        let ids = seed_payments(env, total - all.len()).await?;
        seed_charges(&provider, &ids).await?;
        all.extend(ids);

        let started = Instant::now();
        for id in &all {
            provider.charges_by_reference(&id.to_string()).await?;
        }
        let lookups = all.len() as f64 / started.elapsed().as_secs_f64();

        let started = Instant::now();
        let report = run_once(&env.pool, &provider, &cfg).await?;
        let took = started.elapsed();
        anyhow::ensure!(report.ran, "the run did not take its lock");
        anyhow::ensure!(
            report.payments == all.len(),
            "compared {} payments of {}",
            report.payments,
            all.len()
        );
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM demo.reconciliation_cases WHERE resolved_at IS NULL AND kind = 'recorded_not_charged'",
        )
        .fetch_one(&env.pool)
        .await?;
        anyhow::ensure!(
            open as usize == all.len() / MISSING_EVERY,
            "{open} open recorded_not_charged cases, expected {}",
            all.len() / MISSING_EVERY
        );
        lines.push(
            Line::new(
                &format!("reconciliation run ({} payments)", all.len()),
                all.len() as f64 / took.as_secs_f64(),
                "payments/s",
            )
            .vs_ceiling(lookups, None)
            .note(format!(
                "one run took {:.1} s and found every one of the {open} payments without a charge; ceiling = the same provider lookups (GET /charges?reference=, one at a time) without the database",
                took.as_secs_f64()
            )),
        );
    }
    env::stop(provider_process).await;
    Ok(lines)
}
