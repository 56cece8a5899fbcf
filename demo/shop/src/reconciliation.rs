//! Regular reconciliation with the payment provider: compares the provider's charges
//! (`GET /charges?reference=<payment id>`) with `demo.payments` and turns every mismatch into a
//! case in `demo.reconciliation_cases`, with its evidence, for a person to resolve. It never moves
//! money. A run closes the open cases it no longer observes (resolution `no longer observed`).
//!
//! One instance at a time: a run holds a session advisory lock for its duration; a worker whose
//! try-lock fails skips the run (another worker is reconciling).
//!
//! Mismatch kinds ([`Kind`]), over payments created in the last `window` and older than `settle`
//! (so payments in flight are left to their process):
//! - `charged_not_recorded`: a charge took money (succeeded) but the payment is failed, or still
//!   pending with its process finished or in review;
//! - `recorded_not_charged`: the payment succeeded but the provider has no charge that took money;
//! - `amount_mismatch`: the charge that took money differs in amount or currency;
//! - `pending_too_long`: the payment is still pending after `pending_threshold`.

use payment_provider::api::{Charge, ChargeStatus};
use payment_provider::client::{Client, QueryError};
use serde_json::json;
use sqlx::{PgPool, Row};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// What kind of mismatch a case is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    ChargedNotRecorded,
    RecordedNotCharged,
    AmountMismatch,
    PendingTooLong,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::ChargedNotRecorded,
        Kind::RecordedNotCharged,
        Kind::AmountMismatch,
        Kind::PendingTooLong,
    ];
    /// The name stored in `demo.reconciliation_cases.kind` and the metrics' `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::ChargedNotRecorded => "charged_not_recorded",
            Kind::RecordedNotCharged => "recorded_not_charged",
            Kind::AmountMismatch => "amount_mismatch",
            Kind::PendingTooLong => "pending_too_long",
        }
    }
}

/// How the job runs.
#[derive(Debug, Clone)]
pub struct ReconcileConfig {
    /// Between runs (`RECONCILE_INTERVAL`).
    pub interval: Duration,
    /// Payments younger than this are left to their process.
    pub settle: Duration,
    /// A payment pending longer than this is a case (`RECONCILE_PENDING_THRESHOLD`).
    pub pending_threshold: Duration,
    /// Payments created within this window are compared.
    pub window: Duration,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(300),
            settle: Duration::from_secs(60),
            pending_threshold: Duration::from_secs(3600),
            window: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("database")]
    Database(#[from] sqlx::Error),
    #[error("the provider's records could not be read")]
    Provider(#[from] QueryError),
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// false: another instance held the lock; nothing was compared.
    pub ran: bool,
    pub payments: usize,
    /// Cases opened by this run, by kind.
    pub found: HashMap<&'static str, usize>,
    /// Open cases closed by this run (no longer observed), by kind.
    pub resolved: HashMap<&'static str, usize>,
}

const LOCK_KEY: &str = "demo.reconciliation";

struct Payment {
    id: Uuid,
    amount: i64,
    currency: String,
    status: String,
    process: Option<String>,
    age: Duration,
}

/// The mismatches of one payment against its charges.
fn mismatches(p: &Payment, charges: &[Charge], cfg: &ReconcileConfig) -> Vec<Kind> {
    let taken = charges.iter().find(|c| c.status == ChargeStatus::Succeeded);
    let mut out = Vec::new();
    let settled_process = p
        .process
        .as_deref()
        .and_then(processes::ProcessStatus::parse)
        .is_some_and(|s| {
            use processes::ProcessStatus as S;
            matches!(
                s,
                S::Succeeded | S::Failed | S::Compensated | S::ManualReview
            )
        });
    match (p.status.as_str(), taken) {
        ("failed", Some(_)) => out.push(Kind::ChargedNotRecorded),
        ("pending", Some(_)) if settled_process => out.push(Kind::ChargedNotRecorded),
        ("succeeded", None) => out.push(Kind::RecordedNotCharged),
        _ => {}
    }
    if let Some(c) = taken
        && p.status == "succeeded"
        && (c.amount != p.amount || c.currency != p.currency)
    {
        out.push(Kind::AmountMismatch);
    }
    if p.status == "pending" && p.age >= cfg.pending_threshold {
        out.push(Kind::PendingTooLong);
    }
    out
}

/// One run: under the lock, compare, open cases for new mismatches, close those gone.
pub async fn run_once(
    pool: &PgPool,
    provider: &Client,
    cfg: &ReconcileConfig,
) -> Result<Report, ReconcileError> {
    let started = Instant::now();
    let mut lock = pool.acquire().await?;
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
        .bind(LOCK_KEY)
        .fetch_one(&mut *lock)
        .await?;
    if !got {
        return Ok(Report::default());
    }
    let result = compare(pool, provider, cfg).await;
    let _ = sqlx::query("SELECT pg_advisory_unlock(hashtextextended($1, 0))")
        .bind(LOCK_KEY)
        .execute(&mut *lock)
        .await;
    let report = result?;
    metrics_after(pool, &report, cfg, started.elapsed()).await?;
    Ok(report)
}

async fn compare(
    pool: &PgPool,
    provider: &Client,
    cfg: &ReconcileConfig,
) -> Result<Report, ReconcileError> {
    let rows = sqlx::query(
        "SELECT p.id, p.amount, p.currency, p.status, pr.status AS process,
                extract(epoch FROM now() - p.created_at)::float8 AS age
         FROM demo.payments p
         LEFT JOIN outbox.processes pr ON pr.kind = 'payment' AND pr.business_key = p.id::text
              AND pr.revision = 0
         WHERE p.created_at > now() - make_interval(secs => $1)
           AND p.created_at < now() - make_interval(secs => $2)
         ORDER BY p.created_at",
    )
    .bind(cfg.window.as_secs_f64())
    .bind(cfg.settle.as_secs_f64())
    .fetch_all(pool)
    .await?;
    // Payments with open cases: only they (and new mismatches) need a write.
    let open: std::collections::HashSet<Uuid> = sqlx::query_scalar(
        "SELECT DISTINCT payment_id FROM demo.reconciliation_cases WHERE resolved_at IS NULL",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let mut report = Report {
        ran: true,
        ..Report::default()
    };
    for r in &rows {
        let p = Payment {
            id: r.try_get("id")?,
            amount: r.try_get("amount")?,
            currency: r.try_get("currency")?,
            status: r.try_get("status")?,
            process: r.try_get("process")?,
            age: Duration::from_secs_f64(r.try_get::<f64, _>("age")?.max(0.0)),
        };
        let charges = provider.charges_by_reference(&p.id.to_string()).await?;
        let found = mismatches(&p, &charges, cfg);
        if found.is_empty() && !open.contains(&p.id) {
            // In agreement, and nothing to close: no transaction.
            continue;
        }
        let evidence = json!({
            "payment": {"id": p.id, "status": p.status, "process": p.process,
                        "amount": p.amount, "currency": p.currency, "age_seconds": p.age.as_secs()},
            "provider_charges": charges,
        });
        let mut tx = pool.begin().await?;
        for kind in &found {
            let opened = sqlx::query(
                "INSERT INTO demo.reconciliation_cases (payment_id, kind, evidence) VALUES ($1, $2, $3)
                 ON CONFLICT (payment_id, kind) WHERE resolved_at IS NULL
                 DO UPDATE SET last_seen_at = now(), evidence = EXCLUDED.evidence
                 RETURNING (xmax = 0) AS inserted",
            )
            .bind(p.id)
            .bind(kind.as_str())
            .bind(&evidence)
            .fetch_one(&mut *tx)
            .await?
            .try_get::<bool, _>("inserted")?;
            if opened {
                *report.found.entry(kind.as_str()).or_default() += 1;
                metrics::counter!("reconciliation_mismatches_found_total", "kind" => kind.as_str())
                    .increment(1);
                tracing::warn!(payment = %p.id, kind = kind.as_str(), "reconciliation: mismatch with the provider; case opened for manual review");
            }
        }
        let kinds: Vec<&str> = found.iter().map(|k| k.as_str()).collect();
        let closed: Vec<String> = sqlx::query_scalar(
            "UPDATE demo.reconciliation_cases SET resolved_at = now(), resolution = 'no longer observed'
             WHERE payment_id = $1 AND resolved_at IS NULL AND NOT (kind = ANY($2))
             RETURNING kind",
        )
        .bind(p.id)
        .bind(&kinds)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        for k in closed {
            if let Some(kind) = Kind::ALL.into_iter().find(|x| x.as_str() == k) {
                *report.resolved.entry(kind.as_str()).or_default() += 1;
                metrics::counter!("reconciliation_mismatches_resolved_total", "kind" => kind.as_str())
                    .increment(1);
            }
        }
    }
    report.payments = rows.len();
    Ok(report)
}

async fn metrics_after(
    pool: &PgPool,
    report: &Report,
    cfg: &ReconcileConfig,
    took: Duration,
) -> Result<(), sqlx::Error> {
    let rows = sqlx::query(
        "SELECT kind, count(*) AS n, extract(epoch FROM now() - min(found_at))::float8 AS oldest
         FROM demo.reconciliation_cases WHERE resolved_at IS NULL GROUP BY kind",
    )
    .fetch_all(pool)
    .await?;
    let mut open: HashMap<String, (i64, f64)> = HashMap::new();
    for r in &rows {
        open.insert(r.try_get("kind")?, (r.try_get("n")?, r.try_get("oldest")?));
    }
    let mut oldest = 0.0f64;
    let mut total = 0;
    for kind in Kind::ALL {
        let (n, age) = open.get(kind.as_str()).copied().unwrap_or((0, 0.0));
        total += n;
        oldest = oldest.max(age);
        metrics::gauge!("reconciliation_unresolved", "kind" => kind.as_str()).set(n as f64);
    }
    metrics::gauge!("reconciliation_unresolved_oldest_age_seconds").set(oldest);
    let pending: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM demo.payments WHERE status = 'pending'
         AND created_at < now() - make_interval(secs => $1)",
    )
    .bind(cfg.pending_threshold.as_secs_f64())
    .fetch_one(pool)
    .await?;
    metrics::gauge!("reconciliation_pending_too_long").set(pending as f64);
    metrics::gauge!("reconciliation_last_success_timestamp_seconds")
        .set(chrono::Utc::now().timestamp() as f64);
    metrics::histogram!("reconciliation_run_duration_seconds").record(took.as_secs_f64());
    tracing::info!(payments = report.payments, open = total, took = ?took, found = ?report.found, resolved = ?report.resolved, "reconciliation run");
    Ok(())
}

/// Runs [`run_once`] every `cfg.interval` until `shutdown`.
pub async fn run(
    pool: PgPool,
    provider: Client,
    cfg: ReconcileConfig,
    shutdown: CancellationToken,
) {
    loop {
        match run_once(&pool, &provider, &cfg).await {
            Ok(_) => {}
            Err(e) => {
                metrics::counter!("reconciliation_run_failures_total").increment(1);
                tracing::warn!(error = %e, "reconciliation run failed; next run at the next interval");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.interval) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
