//! Receiving signed webhooks once: a library piece any service mounts (see docs/webhooks.md).
//!
//! ```ignore
//! struct Payments;
//! impl WebhookHandler for Payments {
//!     fn version(&self, e: &WebhookEvent) -> Option<ObjectVersion> {
//!         let rank = match e.kind.as_str() { "charge.refunded" => 2, _ => 1 };
//!         Some(ObjectVersion { object: e.object_id.clone()?, position: rank })
//!     }
//!     async fn handle(&self, tx: &mut PgConnection, e: &WebhookEvent) -> Result<(), HandlerError> {
//!         sqlx::query("UPDATE payments SET ...").execute(&mut *tx).await?;
//!         Ok(())
//!     }
//! }
//! let receiver = WebhookReceiver::new(pool, "provider", secret, Payments).schema(schema);
//! Router::new().route("/webhooks/provider", receiver.into_route())
//! ```
//!
//! A short tour:
//! - [`receiver`]: [`WebhookReceiver`], the request's life: body limit, signature, envelope, the
//!   inbox transaction with the handler, the answer.
//! - [`signature`]: `t=..,v1=..` parsed and verified in constant time, the tolerance; [`sign`] for
//!   senders and tests.
//! - [`event`]: [`WebhookEvent`], the verified body's envelope (`id`, `type`, `created`,
//!   `data.object`).
//! - [`handler`]: [`WebhookHandler`], what the service supplies; [`ObjectVersion`], the ordering
//!   rule; [`HandlerError`].
//! - [`inbox`]: the rows in `{{schema}}.webhook_inbox` and `{{schema}}.webhook_objects`.
//! - [`error`]: [`WebhookError`], every refusal (`{"error"}` only) and failure.
//! - [`internal_events`]: every metric.

pub mod error;
pub mod event;
pub mod handler;
pub mod inbox;
pub mod internal_events;
pub mod receiver;
pub mod signature;

pub use error::WebhookError;
pub use event::WebhookEvent;
pub use handler::{HandlerError, ObjectVersion, WebhookHandler};
pub use inbox::InboxOutcome;
pub use receiver::{
    DEFAULT_MAX_BODY, DEFAULT_SIGNATURE_HEADER, DEFAULT_TOLERANCE, Received, WebhookReceiver,
};
pub use signature::{Signature, SignatureError, sign};
