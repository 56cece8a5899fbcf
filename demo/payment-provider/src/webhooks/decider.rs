//! The decider: moves pending async charges whose `decide_at` has come to their planned outcome
//! and records the event (`charge.succeeded` or `charge.failed`) in the same transaction.

use crate::api::{ChargeStatus, EventType};
use crate::charges::ChargeRow;
use crate::error::ApiError;
use crate::state::AppState;
use crate::webhooks::{POLL_INTERVAL, events};
use chrono::Utc;
use plumbing::telemetry::ErrorChain;

/// Charges decided per transaction.
const BATCH: i64 = 100;

/// Decides due charges until shutdown.
pub async fn run(state: AppState) {
    loop {
        match decide_due(&state).await {
            Ok(n) if n as i64 >= BATCH => continue,
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "deciding pending charges failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
            _ = state.shutdown.cancelled() => return,
        }
    }
}

/// Decides the charges that are due now; returns how many.
pub async fn decide_due(state: &AppState) -> Result<usize, ApiError> {
    let mut tx = state.pool.begin().await?;
    let rows: Vec<ChargeRow> = sqlx::query_as(
        "UPDATE provider.charges c SET status = c.planned_status
          WHERE c.id IN (SELECT id FROM provider.charges
                          WHERE status = 'pending' AND decide_at <= $1
                          ORDER BY decide_at LIMIT $2 FOR UPDATE SKIP LOCKED)
          RETURNING id, reference, amount, currency, status, idempotency_key, created_at, refunded_at",
    )
    .bind(Utc::now())
    .bind(BATCH)
    .fetch_all(&mut *tx)
    .await?;
    let n = rows.len();
    for row in rows {
        let charge = row.into_charge()?;
        let kind = match charge.status {
            ChargeStatus::Declined => EventType::ChargeFailed,
            _ => EventType::ChargeSucceeded,
        };
        let strikes = state.faults.draw();
        events::record(&mut tx, &charge, kind, strikes, &state.webhooks).await?;
    }
    tx.commit().await?;
    Ok(n)
}
