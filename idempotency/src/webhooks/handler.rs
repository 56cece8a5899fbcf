//! [`WebhookHandler`]: what a service supplies to the receiver: the effect of an event, run in the
//! transaction of its inbox row, and (optionally) where the event stands in its object's history,
//! so that an older event arriving after a newer one does not move the object backwards.

use crate::webhooks::event::WebhookEvent;
use sqlx::PgConnection;
use std::future::Future;

/// Where an event stands in the history of the object it is about.
///
/// The receiver keeps, per (source, object), the highest position applied so far
/// (`webhook_objects`). An event whose position is not higher is recorded as `superseded` and its
/// handler does not run. The position must therefore grow with the object's state: a rank of the
/// state (`pending` 0, `succeeded`/`failed` 1, `refunded` 2), the object's version if the provider
/// sends one, or the event's time in microseconds if the provider's clock orders its events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectVersion {
    /// The object's id (by default `data.object.id`).
    pub object: String,
    pub position: i64,
}

/// The handler failed: the inbox row and everything the handler wrote roll back, the provider is
/// answered 500 and retries, and the retry applies the event once.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct HandlerError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl HandlerError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }

    pub fn with_source(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        Self::with_source("database error in the webhook handler", e)
    }
}

/// A service's reaction to its webhooks.
pub trait WebhookHandler: Send + Sync + 'static {
    /// The event's place in its object's history, or `None` (the default) when the events of
    /// this source need no ordering: every new event is applied.
    fn version(&self, event: &WebhookEvent) -> Option<ObjectVersion> {
        let _ = event;
        None
    }

    /// Applies `event`, writing only through `tx`: the transaction that holds its inbox row, so
    /// the effect commits exactly when the event is recorded as received. Return `Ok` for events
    /// the service ignores (they are recorded too); an error rolls both back and the provider
    /// retries.
    fn handle(
        &self,
        tx: &mut PgConnection,
        event: &WebhookEvent,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}
