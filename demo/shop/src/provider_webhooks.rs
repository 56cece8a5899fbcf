//! `POST /webhooks/provider`: the payment provider's webhooks (async mode), received with the
//! `idempotency` crate's [`WebhookReceiver`]: verified, recorded once in the product's
//! `webhook_inbox`, and applied by [`ProviderEvents`], which records each event for its payment in
//! `demo.payment_events` in the same transaction. Mounted only when `PROVIDER_WEBHOOK_SECRET` is
//! set. A decided charge (succeeded, declined) also wakes the payment process waiting for it
//! ([`processes::signal()`] for `charge:<charge id>`), in the same transaction as the inbox row: the
//! process's confirmation step takes it (an event that comes before the process waits is kept).

use idempotency::webhooks::{
    HandlerError, ObjectVersion, WebhookEvent, WebhookHandler, WebhookReceiver,
};
use payment_provider::api::{Charge, ChargeStatus};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// The receiver's name in the inbox.
pub const SOURCE: &str = "payment-provider";

/// The secret the provider signs with (`PROVIDER_WEBHOOK_SECRET`); never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(pub String);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(***)")
    }
}

/// Records the provider's charge events for the demo's payments and wakes their processes.
#[derive(Debug, Clone, Default)]
pub struct ProviderEvents {
    /// The product schema (processes).
    pub schema: Schema,
}

/// A charge's place in its lifecycle: decided (succeeded or declined) before refunded. An older
/// event arriving after a newer one (the provider's `webhook_reorder`) is superseded.
fn rank(status: ChargeStatus) -> i64 {
    match status {
        ChargeStatus::Pending => 0,
        ChargeStatus::Succeeded | ChargeStatus::Declined => 1,
        ChargeStatus::Refunded => 2,
    }
}

impl WebhookHandler for ProviderEvents {
    fn version(&self, event: &WebhookEvent) -> Option<ObjectVersion> {
        let charge: Charge = event.object().ok()?;
        Some(ObjectVersion {
            object: charge.id.to_string(),
            position: rank(charge.status),
        })
    }

    async fn handle(
        &self,
        tx: &mut PgConnection,
        event: &WebhookEvent,
    ) -> Result<(), HandlerError> {
        // Not a charge event: recorded in the inbox, nothing to do (a retry would not help).
        let Ok(charge) = event.object::<Charge>() else {
            tracing::info!(event = %event.id, kind = %event.kind, "provider event without a charge ignored");
            return Ok(());
        };
        let payment: Option<Uuid> = match charge.reference.parse::<Uuid>() {
            Ok(id) => {
                sqlx::query_scalar("SELECT id FROM demo.payments WHERE id = $1")
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await?
            }
            Err(_) => None,
        };
        sqlx::query(
            "INSERT INTO demo.payment_events
                    (event_id, payment_id, charge_id, type, charge_status, amount, currency, occurred_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(&event.id)
        .bind(payment)
        .bind(charge.id)
        .bind(&event.kind)
        .bind(charge.status.as_str())
        .bind(charge.amount)
        .bind(&charge.currency)
        .bind(event.created)
        .execute(&mut *tx)
        .await?;
        if matches!(
            charge.status,
            ChargeStatus::Succeeded | ChargeStatus::Declined
        ) {
            let key = crate::payment_process::confirmation_key(&charge.id.to_string());
            let payload = serde_json::json!({
                "status": charge.status.as_str(),
                "charge_id": charge.id,
                "amount": charge.amount,
                "currency": charge.currency,
            });
            processes::signal(
                tx,
                &self.schema,
                &key,
                &payload,
                &format!("webhook:{}", event.id),
            )
            .await?;
        }
        Ok(())
    }
}

/// The receiver to mount at `POST /webhooks/provider`.
pub fn receiver(
    pool: PgPool,
    schema: Schema,
    secret: &WebhookSecret,
) -> WebhookReceiver<ProviderEvents> {
    let events = ProviderEvents {
        schema: schema.clone(),
    };
    WebhookReceiver::new(pool, SOURCE, secret.0.as_bytes(), events).schema(schema)
}
