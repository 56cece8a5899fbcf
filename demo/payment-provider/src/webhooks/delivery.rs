//! The deliverer: POSTs due events to `PROVIDER_WEBHOOK_URL`, signed, and retries with
//! exponential backoff (full jitter) until a 2xx comes back or `PROVIDER_WEBHOOK_MAX_ATTEMPTS`
//! are used up. Per round it takes the oldest due event of each charge, so the events of one
//! charge go out in order unless a fault or a failed attempt reorders them, as with real
//! providers.
//!
//! The faults stored with an event act here: `webhook_5xx_retry` counts the first attempt as
//! failed whatever came back (the receiver got it; the provider retries anyway),
//! `webhook_duplicate` sends the event once more right after its first success, and the delivery
//! of any event releases the `webhook_reorder`-held earlier events of its charge.

use crate::api::SIGNATURE_HEADER;
use crate::internal_events::{self, DeliveryOutcome};
use crate::state::AppState;
use crate::webhooks::events::later;
use crate::webhooks::{POLL_INTERVAL, WebhookSettings, signature};
use chrono::{DateTime, Utc};
use plumbing::telemetry::ErrorChain;
use uuid::Uuid;

/// Events sent per round (concurrently, at most one per charge).
const BATCH: i64 = 32;

#[derive(Debug, sqlx::FromRow)]
struct DueEvent {
    id: String,
    charge_id: Uuid,
    body: String,
    faults: Vec<String>,
    attempts: i32,
    created_at: DateTime<Utc>,
}

/// Delivers due events until shutdown. Does nothing without `PROVIDER_WEBHOOK_URL`.
pub async fn run(state: AppState) {
    let Some(url) = state.webhooks.url.clone() else {
        return;
    };
    let client = match reqwest::Client::builder()
        .timeout(state.webhooks.timeout)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %ErrorChain(&e), "cannot build the webhook client: no events are sent");
            return;
        }
    };
    loop {
        match deliver_due(&state, &client, &url).await {
            Ok(n) if n > 0 => continue,
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "delivering webhook events failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
            _ = state.shutdown.cancelled() => return,
        }
    }
}

/// One round: the oldest due event of each charge, sent concurrently; returns how many.
async fn deliver_due(
    state: &AppState,
    client: &reqwest::Client,
    url: &str,
) -> Result<usize, sqlx::Error> {
    let due: Vec<DueEvent> = sqlx::query_as(
        "SELECT * FROM (
             SELECT DISTINCT ON (charge_id) id, charge_id, body, faults, attempts, created_at, next_attempt_at
               FROM provider.events
              WHERE status = 'scheduled' AND next_attempt_at <= $1
              ORDER BY charge_id, created_at) d
          ORDER BY next_attempt_at LIMIT $2",
    )
    .bind(Utc::now())
    .bind(BATCH)
    .fetch_all(&state.pool)
    .await?;
    let n = due.len();
    let results = futures::future::join_all(
        due.into_iter()
            .map(|event| deliver(state, client, url, event)),
    )
    .await;
    results.into_iter().collect::<Result<Vec<()>, _>>()?;
    Ok(n)
}

/// One attempt at one event, and its bookkeeping.
async fn deliver(
    state: &AppState,
    client: &reqwest::Client,
    url: &str,
    event: DueEvent,
) -> Result<(), sqlx::Error> {
    let settings: &WebhookSettings = &state.webhooks;
    let (mut ok, mut response) = send(client, url, &settings.secret, &event.body).await;
    let mut sends = 1;
    let attempts = event.attempts.saturating_add(1);
    if ok && event.attempts == 0 && has(&event, "webhook_5xx_retry") {
        ok = false;
        response = format!("{response}, counted as 503 (webhook_5xx_retry)");
    }
    // After the first 2xx (whichever attempt it was) the event is never sent again: once more.
    if ok && has(&event, "webhook_duplicate") {
        let (_, second) = send(client, url, &settings.secret, &event.body).await;
        sends += 1;
        response = format!("{response}; duplicate: {second}");
        internal_events::delivery(DeliveryOutcome::Duplicate);
    }
    let now = Utc::now();
    if ok {
        internal_events::delivery(DeliveryOutcome::Delivered);
        let mut tx = state.pool.begin().await?;
        sqlx::query(
            "UPDATE provider.events
                SET status = 'delivered', delivered_at = $2, next_attempt_at = NULL,
                    attempts = $3, sends = sends + $4, last_response = $5
              WHERE id = $1",
        )
        .bind(&event.id)
        .bind(now)
        .bind(attempts)
        .bind(sends)
        .bind(&response)
        .execute(&mut *tx)
        .await?;
        // webhook_reorder: the earlier events of this charge held back go now, after this one.
        sqlx::query(
            "UPDATE provider.events SET next_attempt_at = $3
              WHERE charge_id = $1 AND held AND status = 'scheduled' AND created_at < $2
                AND next_attempt_at > $3",
        )
        .bind(event.charge_id)
        .bind(event.created_at)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        return Ok(());
    }
    let gave_up = attempts >= i32::try_from(settings.max_attempts).unwrap_or(i32::MAX);
    internal_events::delivery(if gave_up {
        DeliveryOutcome::GaveUp
    } else {
        DeliveryOutcome::Failed
    });
    let next = (!gave_up).then(|| {
        let attempt = u32::try_from(attempts).unwrap_or(u32::MAX);
        later(
            now,
            plumbing::backoff::delay(attempt, settings.backoff, settings.backoff_max),
        )
    });
    sqlx::query(
        "UPDATE provider.events
            SET status = $2, next_attempt_at = $3, attempts = $4, sends = sends + $5, last_response = $6
          WHERE id = $1",
    )
    .bind(&event.id)
    .bind(if gave_up { "failed" } else { "scheduled" })
    .bind(next)
    .bind(attempts)
    .bind(sends)
    .bind(&response)
    .execute(&state.pool)
    .await?;
    Ok(())
}

fn has(event: &DueEvent, fault: &str) -> bool {
    event.faults.iter().any(|f| f == fault)
}

/// POSTs `body` signed now; says whether a 2xx came back and what came back.
async fn send(client: &reqwest::Client, url: &str, secret: &str, body: &str) -> (bool, String) {
    let signature = signature::header(secret.as_bytes(), Utc::now().timestamp(), body.as_bytes());
    let result = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(SIGNATURE_HEADER, signature)
        .body(body.to_owned())
        .send()
        .await;
    match result {
        Ok(r) => (r.status().is_success(), r.status().as_u16().to_string()),
        Err(e) => (false, ErrorChain(&e).to_string()),
    }
}
