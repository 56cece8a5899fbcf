//! The example application's consumer that calls a remote: for every `payment.captured` it
//! posts a notification to the notification service (the provider simulator's
//! `POST /notifications`, keyed by the event's message id so a repeated call is one
//! notification), run by `producer notifier`.
//!
//! The service is a dependency ([`NOTIFICATIONS`]): its shared circuit opens when it answers
//! "unavailable", and then the consumer stops calling it. The waiting events stay in RabbitMQ
//! (the retry queues), spend no attempt and are never dead-lettered for the outage.

use crate::ledger::EVENT_TYPE;
use consumer::{Handler, HandlerError, Handlers};
use payment_provider::client::{Client, NotifyError};
use shared::Envelope;
use sqlx::PgConnection;

/// The notification service's name as a dependency.
pub const NOTIFICATIONS: &str = "notifications";

/// Posts a notification for each captured payment.
#[derive(Debug, Clone)]
pub struct Notifier {
    pub client: Client,
}

impl Handler for Notifier {
    async fn handle(&self, _tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        let body = serde_json::json!({
            "event": msg.event_type,
            "aggregate_id": msg.aggregate_id,
            "payment": msg.payload,
        });
        match self.client.notify(&msg.message_id.to_string(), &body).await {
            Ok(_) => Ok(()),
            Err(e @ NotifyError::Unavailable { retry_after, .. }) => {
                Err(HandlerError::unavailable(e, retry_after))
            }
            Err(e @ NotifyError::OutcomeUnknown(_)) => Err(HandlerError::transient(e)),
            Err(e @ NotifyError::Invalid { .. }) => Err(HandlerError::permanent(e)),
        }
    }
}

/// The handlers of `producer notifier`: the notifier for `payment.captured`, through the
/// `notifications` dependency.
pub fn handlers(client: Client, dependency: breaker::Dependency) -> Handlers {
    Handlers::new().on_needing(EVENT_TYPE, dependency, Notifier { client })
}

/// The notification service as a dependency with the default policy.
pub fn dependency() -> Result<breaker::Dependency, breaker::DeclareError> {
    breaker::Dependency::new(NOTIFICATIONS, breaker::Policy::default())
}
