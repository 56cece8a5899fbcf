//! Recording an event: one row of `provider.events`, written in the transaction of the change it
//! reports (the decision, the refund), so no change goes without its event and no event without
//! its change. The webhook faults are drawn here and stored with the event.

use crate::api::{Charge, EventData, EventType, WebhookEvent};
use crate::error::ApiError;
use crate::faults::{FaultMode, Strikes};
use crate::internal_events;
use crate::webhooks::WebhookSettings;
use chrono::{DateTime, TimeDelta, Utc};
use sqlx::PgConnection;
use std::time::Duration;
use uuid::Uuid;

/// The webhook modes, in the order they are listed in `provider.events.faults`.
const WEBHOOK_MODES: [FaultMode; 5] = [
    FaultMode::WebhookLost,
    FaultMode::WebhookDuplicate,
    FaultMode::WebhookDelay,
    FaultMode::WebhookReorder,
    FaultMode::Webhook5xxRetry,
];

/// Records the event `kind` about `charge` (its state right after the change) in `conn`'s
/// transaction, with the webhook faults of `strikes`.
pub async fn record(
    conn: &mut PgConnection,
    charge: &Charge,
    kind: EventType,
    strikes: Strikes,
    settings: &WebhookSettings,
) -> Result<String, ApiError> {
    let now = Utc::now();
    let id = format!("evt_{}", Uuid::new_v4().simple());
    let body = serde_json::to_string(&WebhookEvent {
        id: id.clone(),
        kind,
        created: now.timestamp(),
        data: EventData {
            object: charge.clone(),
        },
    })
    .map_err(|e| ApiError::Corrupt(format!("cannot encode event {id}: {e}")))?;
    let lost = strikes.has(FaultMode::WebhookLost);
    // The later event that overtakes a held one is never held itself: it goes first, then
    // releases the earlier one (see delivery).
    let overtakes: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM provider.events
                         WHERE charge_id = $1 AND held AND status = 'scheduled')",
    )
    .bind(charge.id)
    .fetch_one(&mut *conn)
    .await?;
    let held = strikes.has(FaultMode::WebhookReorder) && !overtakes;
    let mut wait = Duration::ZERO;
    if strikes.has(FaultMode::WebhookDelay) {
        wait += settings.delay;
    }
    if held {
        wait += settings.reorder_window;
    }
    let next_attempt_at = (!lost).then(|| later(now, wait));
    let struck = |m: &FaultMode| strikes.has(*m) && (*m != FaultMode::WebhookReorder || held);
    let faults: Vec<&'static str> = WEBHOOK_MODES
        .into_iter()
        .filter(struck)
        .map(FaultMode::as_str)
        .collect();
    for m in WEBHOOK_MODES.into_iter().filter(struck) {
        internal_events::fault_injected(m, &charge.reference);
    }
    sqlx::query(
        "INSERT INTO provider.events (id, charge_id, type, body, faults, status, held, next_attempt_at, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&id)
    .bind(charge.id)
    .bind(kind.as_str())
    .bind(&body)
    .bind(&faults)
    .bind(if lost { "lost" } else { "scheduled" })
    .bind(held)
    .bind(next_attempt_at)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    internal_events::event_recorded(kind);
    Ok(id)
}

/// `now + d`, saturating.
pub fn later(now: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(d)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}
