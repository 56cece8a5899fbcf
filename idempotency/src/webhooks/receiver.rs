//! [`WebhookReceiver`]: the axum handler a service mounts for one webhook source. For every
//! request, in this order:
//!
//! 1. the body, at most [`WebhookReceiver::max_body`] bytes (413);
//! 2. the signature header over the raw bytes: missing (401), malformed (400), no `v1` matching
//!    under any secret (401, compared in constant time), timestamp outside the tolerance (401);
//! 3. the envelope: a JSON object with a string `id` and `type` (400);
//! 4. one transaction: the inbox row (`ON CONFLICT DO NOTHING`: a duplicate answers 200 and
//!    changes nothing), the object's position if the handler orders this source (an older event
//!    is recorded `superseded`, its handler not run), the service's handler, commit;
//! 5. 200 `{"outcome": "applied" | "superseded" | "duplicate"}` only after the commit. A handler
//!    error or panic, or a database failure, rolls everything back and answers 5xx: the provider
//!    retries and the retry applies the event once.

use crate::store::Clock;
use crate::webhooks::error::WebhookError;
use crate::webhooks::event::WebhookEvent;
use crate::webhooks::handler::WebhookHandler;
use crate::webhooks::inbox::{self, InboxOutcome};
use crate::webhooks::internal_events::{self, FailureCause};
use crate::webhooks::signature::{Signature, SignatureError};
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use chrono::Utc;
use futures::FutureExt;
use shared::schema::Schema;
use sqlx::PgPool;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The default signature header.
pub const DEFAULT_SIGNATURE_HEADER: &str = "provider-signature";
/// The default tolerance of the signature timestamp (Stripe's libraries: 300 s).
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);
/// The default body limit.
pub const DEFAULT_MAX_BODY: usize = 64 * 1024;

/// Receives one source's webhooks: verifies, deduplicates, orders, and runs `H` once per event.
pub struct WebhookReceiver<H> {
    pool: PgPool,
    schema: Schema,
    source: String,
    secrets: Vec<Vec<u8>>,
    header: &'static str,
    header_name: HeaderName,
    tolerance: Duration,
    max_body: usize,
    clock: Clock,
    handler: H,
}

impl<H> std::fmt::Debug for WebhookReceiver<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookReceiver")
            .field("source", &self.source)
            .field("schema", &self.schema)
            .field("header", &self.header)
            .field("tolerance", &self.tolerance)
            .field("max_body", &self.max_body)
            .finish_non_exhaustive()
    }
}

/// What a received webhook came to (the 200 answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Received {
    pub outcome: InboxOutcome,
}

impl<H: WebhookHandler> WebhookReceiver<H> {
    /// A receiver for `source` (1-200 bytes, e.g. `provider`: it scopes event ids in the inbox)
    /// whose events are signed with `secret`. Defaults: schema `outbox`, header
    /// `Provider-Signature`, tolerance 5 minutes, body limit 64 KiB, the system clock.
    ///
    /// # Panics
    /// When `source` is empty or over 200 bytes, or `secret` is empty: a programming or
    /// configuration error, found at start-up.
    pub fn new(pool: PgPool, source: &str, secret: impl Into<Vec<u8>>, handler: H) -> Self {
        assert!(
            (1..=200).contains(&source.len()),
            "a webhook source must be 1 to 200 bytes, got {source:?}"
        );
        let secret = secret.into();
        assert!(!secret.is_empty(), "a webhook secret must not be empty");
        internal_events::describe(source);
        Self {
            pool,
            schema: Schema::default(),
            source: source.to_owned(),
            secrets: vec![secret],
            header: DEFAULT_SIGNATURE_HEADER,
            header_name: HeaderName::from_static(DEFAULT_SIGNATURE_HEADER),
            tolerance: DEFAULT_TOLERANCE,
            max_body: DEFAULT_MAX_BODY,
            clock: Arc::new(Utc::now),
            handler,
        }
    }

    /// The product schema holding `webhook_inbox` and `webhook_objects`.
    pub fn schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// Accepts signatures under another secret too (a rotation: add the new one, switch the
    /// provider, drop the old one).
    pub fn also_accept(mut self, secret: impl Into<Vec<u8>>) -> Self {
        let secret = secret.into();
        if !secret.is_empty() {
            self.secrets.push(secret);
        }
        self
    }

    /// The header carrying the signature (`Stripe-Signature` for Stripe; any case).
    ///
    /// # Panics
    /// When `header` is no valid header name: a programming error, found at start-up.
    pub fn signature_header(mut self, header: &'static str) -> Self {
        self.header_name = HeaderName::from_bytes(header.as_bytes())
            .unwrap_or_else(|_| panic!("{header:?} is no valid header name"));
        self.header = header;
        self
    }

    /// How far the signature's timestamp may be from now, either way.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The largest body accepted.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// Replaces the clock the timestamp is compared with.
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The route to mount: `Router::new().route("/webhooks/provider", receiver.into_route())`.
    /// Only POST; other methods get the router's 405.
    pub fn into_route<S: Clone + Send + Sync + 'static>(self) -> MethodRouter<S> {
        let receiver = Arc::new(self);
        axum::routing::post(move |request: Request| {
            let receiver = Arc::clone(&receiver);
            async move { receiver.respond(request).await }
        })
    }

    /// Handles one request and answers it.
    pub async fn respond(&self, request: Request) -> Response {
        let (parts, body) = request.into_parts();
        match self.read(body).await {
            Ok(bytes) => match self.receive(&parts.headers, &bytes).await {
                Ok(received) => (StatusCode::OK, axum::Json(received)).into_response(),
                Err(e) => e.into_response(),
            },
            Err(e) => e.into_response(),
        }
    }

    async fn read(&self, body: Body) -> Result<Bytes, WebhookError> {
        axum::body::to_bytes(body, self.max_body)
            .await
            .map_err(|e| {
                let too_large = std::error::Error::source(&e)
                    .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
                if too_large {
                    internal_events::refused(&self.source, "body_too_large");
                    WebhookError::BodyTooLarge {
                        limit: self.max_body,
                    }
                } else {
                    WebhookError::BodyUnreadable
                }
            })
    }

    /// Verifies, records and applies one delivery (`headers` and the raw `body`); usable without
    /// axum's routing, e.g. from a service's own handler.
    pub async fn receive(
        &self,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Received, WebhookError> {
        let event = self.verify(headers, body).inspect_err(|e| match e {
            WebhookError::Signature(s) => {
                internal_events::signature_failure(&self.source, s.reason())
            }
            _ => internal_events::refused(&self.source, "bad_payload"),
        })?;
        let started = Instant::now();
        let outcome = self.record(&event).await.inspect_err(|e| {
            internal_events::handler_failure(
                &self.source,
                match e {
                    WebhookError::Handler(_) => FailureCause::Error,
                    WebhookError::Panicked(_) => FailureCause::Panic,
                    _ => FailureCause::Database,
                },
            )
        })?;
        internal_events::received(&self.source, outcome, started.elapsed());
        Ok(Received { outcome })
    }

    /// Steps 2 and 3: the signature over the raw bytes, then the envelope.
    fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<WebhookEvent, WebhookError> {
        let mut values = headers.get_all(&self.header_name).iter();
        let value = values.next().ok_or(SignatureError::Unsigned(self.header))?;
        if values.next().is_some() {
            return Err(SignatureError::Malformed {
                header: self.header,
                reason: "the header is given more than once",
            }
            .into());
        }
        let signature = Signature::parse(value.as_bytes(), self.header)?;
        let signed_at = signature.verify(&self.secrets, body, (self.clock)(), self.tolerance)?;
        Ok(WebhookEvent::parse(body, signed_at)?)
    }

    /// Step 4: the transaction.
    async fn record(&self, event: &WebhookEvent) -> Result<InboxOutcome, WebhookError> {
        let version = self.handler.version(event);
        let mut tx = self.pool.begin().await?;
        if !inbox::insert(&mut tx, &self.schema, &self.source, event, version.as_ref()).await? {
            tx.rollback().await?;
            return Ok(InboxOutcome::Duplicate);
        }
        if let Some(v) = &version
            && !inbox::advance(&mut tx, &self.schema, &self.source, &event.id, v).await?
        {
            inbox::mark_superseded(&mut tx, &self.schema, &self.source, &event.id).await?;
            tx.commit().await?;
            return Ok(InboxOutcome::Superseded);
        }
        let handled = AssertUnwindSafe(self.handler.handle(&mut tx, event))
            .catch_unwind()
            .await;
        match handled {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(WebhookError::Handler(e)),
            Err(panic) => return Err(WebhookError::Panicked(panic_message(&panic))),
        }
        tx.commit().await?;
        Ok(InboxOutcome::Applied)
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
