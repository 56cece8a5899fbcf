//! The handler contract and the per-event-type registry.
//!
//! A [`Handler`] gets the open transaction and the decoded [`Envelope`] and applies the event's
//! effect through the transaction. The runtime has already recorded the message as processed in
//! that same transaction, commits after the handler returns `Ok`, and acknowledges the delivery
//! after the commit. On `Err` the handler's writes are rolled back and the message is retried
//! ([`HandlerError::Transient`], or a database error) or dead-lettered ([`HandlerError::Permanent`]).
//!
//! A handler may be called more than once for a message (a batch is re-run after a failure of
//! another message in it, a delivery is redelivered after a crash); only one call's writes commit.
//! Side effects outside the transaction must therefore be idempotent on `msg.message_id`.

use futures::future::BoxFuture;
use shared::Envelope;
use sqlx::PgConnection;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A boxed error that can cross threads (what [`HandlerError`] carries).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// How a handler failed; decides what the runtime does with the message.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Might work later (a row is not there yet, a remote answered oddly): retried after a
    /// delay, dead-lettered after the last attempt.
    #[error("transient failure")]
    Transient(#[source] BoxError),
    /// A remote the handler calls is down or shedding load and did nothing (503, 429, connection
    /// refused): not the message's fault. The message waits in a retry queue without spending an
    /// attempt (never dead-lettered, never parked for it), for at least `retry_after`; when the
    /// handler names the remote as a dependency ([`Handlers::on_needing`]), the dependency's
    /// shared circuit opens and later messages wait without calling the handler at all.
    #[error("remote unavailable")]
    Unavailable {
        #[source]
        source: BoxError,
        retry_after: Option<Duration>,
    },
    /// Will never work (invalid payload, business rule): dead-lettered at once with the reason.
    #[error("permanent failure")]
    Permanent(#[source] BoxError),
    /// A query failed. Connection loss, deadlocks, serialization failures and resource errors
    /// are infrastructure failures: the whole batch is retried with backoff and nothing is
    /// dead-lettered for them. Any other database error counts as a transient failure of this
    /// message.
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

impl HandlerError {
    /// A transient failure from any error or message (`HandlerError::transient("not yet")`).
    pub fn transient(e: impl Into<BoxError>) -> Self {
        Self::Transient(e.into())
    }

    /// A permanent failure from any error or message.
    pub fn permanent(e: impl Into<BoxError>) -> Self {
        Self::Permanent(e.into())
    }

    /// The remote is unavailable (nothing was done), with its `Retry-After` if it gave one.
    pub fn unavailable(e: impl Into<BoxError>, retry_after: Option<Duration>) -> Self {
        Self::Unavailable {
            source: e.into(),
            retry_after,
        }
    }
}

/// Applies the effect of one event inside the runtime's transaction.
///
/// Implement it with an `async fn`:
///
/// ```
/// use consumer::{Handler, HandlerError};
/// use shared::Envelope;
/// use sqlx::PgConnection;
///
/// struct Audit;
///
/// impl Handler for Audit {
///     async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO audit (event_type, body) VALUES ($1, $2)")
///             .bind(&msg.event_type)
///             .bind(&msg.payload)
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
///
/// `tx` is a connection inside an open transaction: run queries on it, never `COMMIT` or
/// `ROLLBACK` it yourself.
pub trait Handler: Send + Sync + 'static {
    /// Applies one message's effect through `tx`.
    fn handle(
        &self,
        tx: &mut PgConnection,
        msg: &Envelope,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Applies several messages at once (for example one multi-row statement instead of one per
    /// message): the throughput path. All or nothing: on any error the runtime rolls the batch
    /// back and runs [`Handler::handle`] per message, each in its own savepoint, so a failing
    /// message fails alone. The default calls `handle` for each message in order.
    ///
    /// `msgs` are distinct messages (duplicates are already filtered out), in delivery order
    /// within each aggregate.
    fn handle_batch(
        &self,
        tx: &mut PgConnection,
        msgs: &[&Envelope],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        async move {
            for msg in msgs {
                self.handle(&mut *tx, msg).await?;
            }
            Ok(())
        }
    }
}

impl<H: Handler> Handler for Arc<H> {
    fn handle(
        &self,
        tx: &mut PgConnection,
        msg: &Envelope,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        (**self).handle(tx, msg)
    }

    fn handle_batch(
        &self,
        tx: &mut PgConnection,
        msgs: &[&Envelope],
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        (**self).handle_batch(tx, msgs)
    }
}

/// Object-safe form of [`Handler`], so handlers of different types share one registry.
pub(crate) trait DynHandler: Send + Sync {
    fn call<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        msg: &'a Envelope,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;

    fn call_batch<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        msgs: &'a [&'a Envelope],
    ) -> BoxFuture<'a, Result<(), HandlerError>>;

    /// The remote the handler calls ([`Handlers::on_needing`]), whose circuit the runtime asks
    /// before each call.
    fn dependency(&self) -> Option<&breaker::Dependency> {
        None
    }
}

/// A handler registered with the dependency it calls.
struct Needing<H> {
    dependency: breaker::Dependency,
    handler: H,
}

impl<H: Handler> DynHandler for Needing<H> {
    fn call<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        msg: &'a Envelope,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(self.handler.handle(tx, msg))
    }

    fn call_batch<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        msgs: &'a [&'a Envelope],
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(self.handler.handle_batch(tx, msgs))
    }

    fn dependency(&self) -> Option<&breaker::Dependency> {
        Some(&self.dependency)
    }
}

impl<H: Handler> DynHandler for H {
    fn call<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        msg: &'a Envelope,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(self.handle(tx, msg))
    }

    fn call_batch<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        msgs: &'a [&'a Envelope],
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(self.handle_batch(tx, msgs))
    }
}

/// Handlers by event type: AMQP topic patterns (`*` matches one dot-separated word, `#` zero or
/// more), tried in registration order, then the optional catch-all.
#[derive(Clone, Default)]
pub struct Handlers {
    routes: Vec<(String, Arc<dyn DynHandler>)>,
    fallback: Option<Arc<dyn DynHandler>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handlers")
            .field("patterns", &self.patterns().collect::<Vec<_>>())
            .field("fallback", &self.fallback.is_some())
            .finish()
    }
}

impl Handlers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` for event types matching `pattern` (e.g. `payment.captured`,
    /// `order.*`, `billing.#`). The first matching registration wins.
    pub fn on(mut self, pattern: impl Into<String>, handler: impl Handler) -> Self {
        self.routes.push((pattern.into(), Arc::new(handler)));
        self
    }

    /// Registers `handler` for `pattern`, naming the remote it calls: before each call the
    /// runtime asks `dependency`'s circuit (shared by every instance, see the `breaker` crate).
    /// While the remote is down, the messages this handler takes wait in a retry queue without
    /// calling it or spending attempts, one probe a cool-down finds out whether the remote is
    /// back, and the other handlers of the consumer flow on. Needs retry delays (the waits are in
    /// the retry queues); ordered mode waits in place.
    pub fn on_needing(
        mut self,
        pattern: impl Into<String>,
        dependency: breaker::Dependency,
        handler: impl Handler,
    ) -> Self {
        self.routes.push((
            pattern.into(),
            Arc::new(Needing {
                dependency,
                handler,
            }),
        ));
        self
    }

    /// Whether some registered handler names a dependency.
    pub fn needs_dependencies(&self) -> bool {
        self.routes.iter().any(|(_, h)| h.dependency().is_some())
            || self
                .fallback
                .as_ref()
                .is_some_and(|h| h.dependency().is_some())
    }

    /// Every dependency a handler names, once by name.
    pub(crate) fn dependencies(&self) -> Vec<&breaker::Dependency> {
        let mut deps: Vec<&breaker::Dependency> = Vec::new();
        for h in self
            .routes
            .iter()
            .map(|(_, h)| h)
            .chain(self.fallback.as_ref())
        {
            if let Some(d) = h.dependency()
                && !deps.iter().any(|x| x.name() == d.name())
            {
                deps.push(d);
            }
        }
        deps
    }

    /// The dependencies of the handlers, if every handler (the fallback included) names one; the
    /// consumer then has nothing to do while all of them hold calls back (see `pause`).
    pub(crate) fn all_dependencies(&self) -> Option<Vec<&breaker::Dependency>> {
        let mut deps: Vec<&breaker::Dependency> = Vec::new();
        for h in self
            .routes
            .iter()
            .map(|(_, h)| h)
            .chain(self.fallback.as_ref())
        {
            let d = h.dependency()?;
            if !deps.iter().any(|x| x.name() == d.name()) {
                deps.push(d);
            }
        }
        (!deps.is_empty()).then_some(deps)
    }

    /// Registers the handler for event types no pattern matches.
    pub fn fallback(mut self, handler: impl Handler) -> Self {
        self.fallback = Some(Arc::new(handler));
        self
    }

    /// The registered patterns, in order.
    pub fn patterns(&self) -> impl Iterator<Item = &str> {
        self.routes.iter().map(|(p, _)| p.as_str())
    }

    /// Whether a catch-all handler is registered.
    pub fn has_fallback(&self) -> bool {
        self.fallback.is_some()
    }

    /// Whether some handler takes `event_type`.
    pub fn handles(&self, event_type: &str) -> bool {
        self.resolve(event_type).is_some()
    }

    /// Binding keys that deliver exactly what these handlers take.
    pub fn default_bindings(&self) -> Vec<String> {
        if self.fallback.is_some() {
            return vec!["#".to_string()];
        }
        let mut keys: Vec<String> = Vec::new();
        for p in self.patterns() {
            if !keys.iter().any(|k| k == p) {
                keys.push(p.to_string());
            }
        }
        keys
    }

    pub(crate) fn resolve(&self, event_type: &str) -> Option<&Arc<dyn DynHandler>> {
        self.routes
            .iter()
            .find(|(p, _)| topic_matches(p, event_type))
            .map(|(_, h)| h)
            .or(self.fallback.as_ref())
    }
}

/// AMQP topic matching: words are separated by `.`, `*` matches exactly one word, `#` zero or more.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let k: Vec<&str> = key.split('.').collect();
    matches_from(&p, &k)
}

fn matches_from(p: &[&str], k: &[&str]) -> bool {
    match p.split_first() {
        None => k.is_empty(),
        Some((&"#", rest)) => (0..=k.len()).any(|skip| matches_from(rest, &k[skip..])),
        Some((&w, rest)) => match k.split_first() {
            Some((&kw, krest)) => (w == "*" || w == kw) && matches_from(rest, krest),
            None => false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_semantics() {
        assert!(topic_matches("payment.captured", "payment.captured"));
        assert!(!topic_matches("payment.captured", "payment.refunded"));
        assert!(topic_matches("payment.*", "payment.refunded"));
        assert!(!topic_matches("payment.*", "payment"));
        assert!(!topic_matches("payment.*", "payment.card.captured"));
        assert!(topic_matches("payment.#", "payment"));
        assert!(topic_matches("payment.#", "payment.card.captured"));
        assert!(topic_matches("#", "anything.at.all"));
        assert!(topic_matches("#.captured", "payment.card.captured"));
        assert!(topic_matches("*.card.#", "payment.card"));
        assert!(!topic_matches("*.card.#", "card"));
        assert!(topic_matches("a.#.z", "a.z"));
        assert!(topic_matches("a.#.z", "a.b.c.z"));
        assert!(!topic_matches("a.#.z", "a.b.c"));
    }

    struct Nop;
    impl Handler for Nop {
        async fn handle(
            &self,
            _tx: &mut PgConnection,
            _msg: &Envelope,
        ) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    #[test]
    fn registry_resolution_and_bindings() {
        let h = Handlers::new()
            .on("payment.captured", Nop)
            .on("order.*", Nop)
            .on("order.*", Nop);
        assert!(h.handles("payment.captured"));
        assert!(h.handles("order.placed"));
        assert!(!h.handles("order.placed.late"));
        assert_eq!(h.default_bindings(), vec!["payment.captured", "order.*"]);
        let h = h.fallback(Nop);
        assert!(h.handles("whatever"));
        assert_eq!(h.default_bindings(), vec!["#"]);
    }
}
