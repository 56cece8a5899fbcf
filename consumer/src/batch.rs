//! The batch transaction, the batch's items (each delivery with its `Work`), and how each
//! message of a batch ends (its `Fate`).
//!
//! Per batch (one worker, deliveries already buffered, up to `batch_size`):
//!
//! 1. Decode. Undecodable messages, and unknown event types in strict mode, are dead-lettered
//!    without touching the database; unknown types otherwise are acknowledged and ignored.
//! 2. `BEGIN`; record every message id in `processed_messages` with one
//!    `INSERT ... ON CONFLICT DO NOTHING RETURNING` (ids already there are duplicates: skipped).
//! 3. Run the handlers in aggregate order on the same transaction. Optimistically without
//!    savepoints; if a handler fails, the transaction is rolled back and the batch re-run with a
//!    `SAVEPOINT` per message, so a failing message is rolled back alone and its dedup row deleted.
//! 4. `COMMIT`. Then publish retried and dead-lettered copies (with publisher confirms), then one
//!    multi-ack for the whole batch. Never an ack before the commit.
//!
//! An infrastructure failure (connection lost, deadlock, ...) rolls the batch back: it is retried
//! with backoff, keeping the deliveries unacknowledged, until it commits or shutdown; nothing is
//! dead-lettered for it.

use crate::context::Ctx;
use crate::dedup;
use crate::handler::{DynHandler, HandlerError};
use crate::internal_events::Events;
use crate::message::DeadLetterKind;
use futures::FutureExt;
use lapin::message::Delivery;
use plumbing::telemetry::ErrorChain;
use shared::Envelope;
use sqlx::PgConnection;
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;
use uuid::Uuid;

/// What to do with a delivery, decided before the transaction.
pub(crate) enum Work {
    Handle(Box<Envelope>, Arc<dyn DynHandler>),
    Reject(DeadLetterKind, String),
    Ignore,
    /// Ordered mode, no handler: the message advances its aggregate's position without an
    /// effect (its turn still comes in order).
    Advance(Box<Envelope>),
    /// A fair share's sorting worker: a copy goes to the key's lane ([`crate::fair`]).
    Lane(String),
}

pub(crate) struct Item {
    pub(crate) delivery: Delivery,
    pub(crate) attempt: u32,
    pub(crate) work: Work,
}

/// How a delivery ends.
#[derive(Debug, Clone)]
pub(crate) enum Fate {
    Processed,
    Duplicate,
    Ignored,
    Retry(String),
    /// A remote its handler needs is unavailable: a copy waits in the retry queue of at least
    /// this delay, its attempt not counted.
    Wait(String, std::time::Duration),
    DeadLetter(DeadLetterKind, String),
    /// Its retry or dead-letter copy could not fit a frame: rejected without requeue.
    Discarded,
    /// Ordered mode: stored to wait for its turn.
    Held,
    /// Ordered mode: at or below its aggregate's position; never applied.
    Stale,
    /// Sorted into a fair share's lane (this queue): a copy goes there, its attempt kept.
    Lane(String),
}

/// A failed handler run: the message's problem, a remote's (unavailable: the message waits at
/// least `wait`, no attempt spent), or the infrastructure's.
pub(crate) enum Failure {
    Message {
        permanent: bool,
        reason: String,
    },
    Unavailable {
        reason: String,
        wait: std::time::Duration,
    },
    Infrastructure(sqlx::Error),
}

/// Runs the batch's handlers in one transaction: optimistically first, with a savepoint per
/// message when a handler failed. Errors are infrastructure failures of the whole batch.
pub(crate) async fn transact(
    ctx: &Ctx,
    events: &Events,
    items: &[Item],
) -> Result<Vec<Option<Fate>>, sqlx::Error> {
    match optimistic(ctx, events, items).await? {
        Some(fates) => Ok(fates),
        None => with_savepoints(ctx, events, items).await,
    }
}

/// A batch's transaction, begun: the messages to run (not duplicates) in aggregate order, and the
/// fates decided so far (the duplicates').
struct Begun<'a> {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    order: Vec<(usize, &'a Envelope, &'a Arc<dyn DynHandler>)>,
    fates: Vec<Option<Fate>>,
}

/// BEGIN and the dedup claim: which messages of the batch run now.
async fn begin<'a>(ctx: &Ctx, items: &'a [Item]) -> Result<Begun<'a>, sqlx::Error> {
    let name = ctx.config.name.as_str();
    let mut fates: Vec<Option<Fate>> = vec![None; items.len()];
    // Aggregate order: the handlers of concurrent batches lock rows in a consistent order,
    // and events of one aggregate in a batch apply in delivery order.
    let mut order: Vec<(usize, &Envelope, &Arc<dyn DynHandler>)> = items
        .iter()
        .enumerate()
        .filter_map(|(i, item)| match &item.work {
            Work::Handle(env, h) => Some((i, env.as_ref(), h)),
            _ => None,
        })
        .collect();
    order.sort_by(|a, b| a.1.aggregate_id.cmp(&b.1.aggregate_id));
    let ids: Vec<Uuid> = order.iter().map(|(_, env, _)| env.message_id).collect();

    let mut tx = plumbing::db::bounded(ctx.pool.begin()).await?;
    let fresh = plumbing::db::bounded(dedup::claim(
        &mut tx,
        &ctx.config.schema,
        name,
        &ids,
        ctx.config.named_statements,
    ))
    .await?;
    let mut claimed: HashSet<Uuid> = HashSet::with_capacity(fresh.len());
    // Not fresh: committed before (by us or another instance). Already claimed: an earlier
    // copy in this batch runs it (if that copy fails, its retry or dead letter carries it on).
    order.retain(|&(i, env, _)| {
        let run = fresh.contains(&env.message_id) && claimed.insert(env.message_id);
        if !run {
            fates[i] = Some(Fate::Duplicate);
        }
        run
    });

    Ok(Begun { tx, order, fates })
}

/// The batch without savepoints, one handler call per run of messages with the same handler:
/// `None` (rolled back) when a handler failed, so the batch is re-run with savepoints.
async fn optimistic(
    ctx: &Ctx,
    events: &Events,
    items: &[Item],
) -> Result<Option<Vec<Option<Fate>>>, sqlx::Error> {
    let Begun {
        mut tx,
        order,
        mut fates,
    } = begin(ctx, items).await?;
    for run in order.chunk_by(|a, b| Arc::ptr_eq(a.2, b.2)) {
        let envs: Vec<&Envelope> = run.iter().map(|(_, env, _)| *env).collect();
        let span = match envs.as_slice() {
            [one] => message_span(one, items[run[0].0].attempt),
            many => tracing::info_span!(
                "batch",
                messages = many.len(),
                message_ids = %MessageIds(many),
            ),
        };
        match run_handler(ctx, events, &mut tx, &envs, run[0].2)
            .instrument(span)
            .await
        {
            Ok(()) => {
                for (i, _, _) in run {
                    fates[*i] = Some(Fate::Processed);
                }
            }
            Err(Failure::Infrastructure(e)) => return Err(e),
            Err(Failure::Message { reason, .. } | Failure::Unavailable { reason, .. }) => {
                tracing::debug!(%reason, messages = run.len(), "handler failed, re-running the batch with a savepoint per message");
                plumbing::db::bounded(tx.rollback()).await?;
                return Ok(None);
            }
        }
    }
    // A handler that swallowed a query error leaves the transaction aborted, and COMMIT
    // would then silently roll back: check, and find the culprit with savepoints.
    if let Err(e) = plumbing::db::bounded(sqlx::raw_sql("SELECT 1").execute(&mut *tx)).await {
        if dedup::is_infrastructure(&e) {
            return Err(e);
        }
        plumbing::db::bounded(tx.rollback()).await?;
        return Ok(None);
    }
    plumbing::db::bounded(tx.commit()).await?;
    Ok(Some(fates))
}

/// The batch with a savepoint per message: a failing message is rolled back alone (its dedup row
/// removed) and gets its retry or dead-letter fate; the others commit.
async fn with_savepoints(
    ctx: &Ctx,
    events: &Events,
    items: &[Item],
) -> Result<Vec<Option<Fate>>, sqlx::Error> {
    let name = ctx.config.name.as_str();
    let Begun {
        mut tx,
        order,
        mut fates,
    } = begin(ctx, items).await?;
    let mut failed: Vec<Uuid> = Vec::new();
    for (i, env, handler) in order {
        let attempt = items[i].attempt;
        let span = message_span(env, attempt);
        plumbing::db::bounded(sqlx::raw_sql("SAVEPOINT consumer_message").execute(&mut *tx))
            .await?;
        let mut result = run_handler(ctx, events, &mut tx, &[env], handler)
            .instrument(span.clone())
            .await;
        if result.is_ok() {
            // Also catches a handler that swallowed a query error and left the transaction aborted.
            if let Err(e) = plumbing::db::bounded(
                sqlx::raw_sql("RELEASE SAVEPOINT consumer_message").execute(&mut *tx),
            )
            .await
            {
                result = Err(classify_db(
                    e,
                    "the handler returned Ok but left its transaction unusable",
                ));
            }
        }
        match result {
            Ok(()) => fates[i] = Some(Fate::Processed),
            Err(Failure::Infrastructure(e)) => return Err(e),
            Err(failure) => {
                plumbing::db::bounded(
                    sqlx::raw_sql("ROLLBACK TO SAVEPOINT consumer_message").execute(&mut *tx),
                )
                .await?;
                plumbing::db::bounded(
                    sqlx::raw_sql("RELEASE SAVEPOINT consumer_message").execute(&mut *tx),
                )
                .await?;
                failed.push(env.message_id);
                let fate = match failure {
                    Failure::Message { permanent, reason } => {
                        fate_of_failure(ctx, permanent, reason, attempt)
                    }
                    Failure::Unavailable { reason, wait } => {
                        fate_of_unavailable(ctx, reason, wait, attempt)
                    }
                    Failure::Infrastructure(e) => return Err(e),
                };
                span.in_scope(|| match &fate {
                    Fate::Retry(reason) => tracing::warn!(%reason, "handler failed, will retry"),
                    Fate::Wait(reason, wait) => {
                        tracing::info!(%reason, ?wait, "remote unavailable, the message waits (no attempt spent)")
                    }
                    Fate::DeadLetter(kind, reason) => {
                        tracing::warn!(kind = kind.as_str(), %reason, "handler failed, dead-lettering")
                    }
                    _ => {}
                });
                fates[i] = Some(fate);
            }
        }
    }
    plumbing::db::bounded(dedup::unclaim(
        &mut tx,
        &ctx.config.schema,
        name,
        &failed,
        ctx.config.named_statements,
    ))
    .await?;
    plumbing::db::bounded(tx.commit()).await?;
    Ok(fates)
}

/// One handler call: a single message (`handle`) or several (`handle_batch`), bounded by the
/// handler timeout, a panic caught and counted as a permanent failure. A handler that names a
/// dependency is called only when the dependency's circuit and limits let it, and its answer is
/// recorded in the circuit.
pub(crate) async fn run_handler(
    ctx: &Ctx,
    events: &Events,
    conn: &mut PgConnection,
    envs: &[&Envelope],
    handler: &Arc<dyn DynHandler>,
) -> Result<(), Failure> {
    let timeout = ctx.config.handler_timeout;
    let permit = match handler.dependency() {
        None => None,
        Some(dep) => match admit(ctx, dep, timeout).await {
            Ok(p) => Some(p),
            Err(f) => {
                if matches!(f, Failure::Unavailable { .. }) {
                    events.dependency_wait(dep.name());
                }
                return Err(f);
            }
        },
    };
    let start = Instant::now();
    let call = match envs {
        [one] => handler.call(conn, one),
        many => handler.call_batch(conn, many),
    };
    let result = tokio::time::timeout(timeout, AssertUnwindSafe(call).catch_unwind()).await;
    events.handler_finished(start.elapsed());
    if let Some(permit) = permit {
        permit.record(health(&result)).await;
    }
    match result {
        Err(_) => Err(Failure::Message {
            permanent: false,
            reason: format!("handler timed out after {timeout:?}"),
        }),
        Ok(Err(panic)) => Err(Failure::Message {
            permanent: true,
            reason: format!("handler panicked: {}", panic_text(&panic)),
        }),
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(HandlerError::Database(e)))) => Err(classify_db(e, "handler query failed")),
        Ok(Ok(Err(e @ HandlerError::Unavailable { retry_after, .. }))) => {
            if let Some(dep) = handler.dependency() {
                events.dependency_wait(dep.name());
            }
            let wait = unavailable_wait(ctx, handler, retry_after);
            Err(Failure::Unavailable {
                reason: ErrorChain(&e).to_string(),
                wait,
            })
        }
        Ok(Ok(Err(e))) => Err(Failure::Message {
            permanent: matches!(e, HandlerError::Permanent(_)),
            reason: ErrorChain(&e).to_string(),
        }),
    }
}

/// Asks `dep` whether the handler may call it now: a permit, or the wait as a failure (the
/// message then waits without the handler being called).
async fn admit(
    ctx: &Ctx,
    dep: &breaker::Dependency,
    timeout: std::time::Duration,
) -> Result<breaker::Permit, Failure> {
    let lease = timeout + std::time::Duration::from_secs(5);
    match dep
        .acquire(&ctx.breaker_pool, &ctx.config.schema, lease)
        .await
    {
        Ok(breaker::Admission::Go(permit)) => Ok(permit),
        Ok(breaker::Admission::Wait(w)) => {
            // Behind a circuit that keeps calls back, a message waits at least the longest
            // cool-down: the circuit decides when the remote is back, and a shorter wait would
            // only cycle every waiting message through the broker once per retry delay.
            let circuit = !matches!(
                w.reason,
                breaker::WaitReason::RateLimited | breaker::WaitReason::Saturated
            );
            let floor = if circuit {
                dep.policy().max_cooldown
            } else {
                std::time::Duration::ZERO
            };
            Err(Failure::Unavailable {
                reason: format!("waiting for {}: {}", dep.name(), w.reason.describe()),
                wait: w.remaining().max(floor),
            })
        }
        Err(e) => Err(Failure::Infrastructure(e)),
    }
}

/// How long a message whose handler's remote answered "unavailable" waits: until the
/// dependency's next probe if its circuit is not letting calls go, else the first retry delay;
/// never before the remote's `Retry-After`.
fn unavailable_wait(
    ctx: &Ctx,
    handler: &Arc<dyn DynHandler>,
    retry_after: Option<std::time::Duration>,
) -> std::time::Duration {
    let circuit = handler
        .dependency()
        .and_then(|d| d.last_seen())
        .filter(|c| !c.lets_through())
        .and_then(|c| c.probe_at.or(c.probe_until))
        .and_then(|t| (t - chrono::Utc::now()).to_std().ok());
    let base = circuit.unwrap_or_else(|| ctx.config.retry_delay(1));
    retry_after.map_or(base, |r| r.max(base))
}

/// A handler call as it ends: within its timeout or not, panicked or not, and what it returned.
type CallResult = Result<
    Result<Result<(), HandlerError>, Box<dyn std::any::Any + Send>>,
    tokio::time::error::Elapsed,
>;

/// What a handler call's result says of its dependency's health: an answer (success, or a
/// permanent refusal) shows it up, "unavailable" shows it down, anything else says neither.
fn health(result: &CallResult) -> breaker::Outcome {
    match result {
        Ok(Ok(Ok(()))) | Ok(Ok(Err(HandlerError::Permanent(_)))) => breaker::Outcome::Answered,
        Ok(Ok(Err(e @ HandlerError::Unavailable { retry_after, .. }))) => {
            breaker::Outcome::Unavailable {
                retry_after: *retry_after,
                message: ErrorChain(e).to_string(),
            }
        }
        _ => breaker::Outcome::NoAnswer,
    }
}

/// A message whose remote is unavailable waits in a retry queue without spending an attempt. A
/// consumer with no retry queue has nowhere to wait (its copy would go straight back to the main
/// queue, a hot loop): there the answer counts as a transient failure, bounded by the attempts.
fn fate_of_unavailable(ctx: &Ctx, reason: String, wait: std::time::Duration, attempt: u32) -> Fate {
    if ctx.topology.retry_queue_at_least(wait).is_some() {
        return Fate::Wait(reason, wait);
    }
    let reason = format!("{reason} (no retry queue to wait in: counted as a transient failure)");
    fate_of_failure(ctx, false, reason, attempt)
}

fn fate_of_failure(ctx: &Ctx, permanent: bool, reason: String, attempt: u32) -> Fate {
    if permanent {
        Fate::DeadLetter(DeadLetterKind::Permanent, reason)
    } else if attempt >= ctx.config.max_attempts {
        Fate::DeadLetter(
            DeadLetterKind::Exhausted,
            format!("gave up after {attempt} attempt(s): {reason}"),
        )
    } else {
        Fate::Retry(reason)
    }
}

/// The span every log line about one message carries.
pub(crate) fn message_span(env: &Envelope, attempt: u32) -> tracing::Span {
    let span = tracing::info_span!(
        "message",
        message_id = %env.message_id,
        event_type = %env.event_type,
        attempt,
        trace_id = tracing::field::Empty,
        traceparent = tracing::field::Empty,
    );
    if let Some(tp) = env.traceparent() {
        span.record("traceparent", tp);
        if let Some(id) = shared::trace::trace_id(Some(tp)) {
            span.record("trace_id", id);
        }
        plumbing::trace::set_parent(&span, tp);
    }
    span
}

/// The ids of a batch, formatted only when a subscriber records the span.
struct MessageIds<'a>(&'a [&'a Envelope]);

impl std::fmt::Display for MessageIds<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (n, env) in self.0.iter().enumerate() {
            if n > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}", env.message_id)?;
        }
        Ok(())
    }
}

pub(crate) fn classify_db(e: sqlx::Error, context: &str) -> Failure {
    if dedup::is_infrastructure(&e) {
        Failure::Infrastructure(e)
    } else {
        Failure::Message {
            permanent: false,
            reason: format!("{context}: {}", ErrorChain(&e)),
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}
