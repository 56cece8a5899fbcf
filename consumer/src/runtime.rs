//! The runtime: a supervisor that (re)connects, workers that consume, and the batch transaction.
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

use crate::config::Config;
use crate::dedup;
use crate::error::{ConfigError, ConsumerError, SessionError};
use crate::handler::{DynHandler, HandlerError, Handlers};
use crate::internal_events::{Events, Outcome, Stats};
use crate::message::{self, DeadLetterKind, headers};
use crate::topology::Topology;
use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, PublisherConfirm};
use plumbing::telemetry::{ErrorChain, Readiness};
use shared::Envelope;
use sqlx::{PgConnection, PgPool};
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

/// Bound on every broker round trip the runtime waits for (declare, confirm, ack, close).
const BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// A configured consumer, ready to [`run`](Consumer::run).
pub struct Consumer {
    ctx: Arc<Ctx>,
}

struct Ctx {
    config: Config,
    pool: PgPool,
    handlers: Handlers,
    topology: Topology,
    bindings: Vec<String>,
    stats: Arc<Stats>,
    readiness: Arc<Readiness>,
}

impl Consumer {
    /// Validates the configuration. `pool` should allow [`Config::pool_size`] connections.
    pub fn new(config: Config, pool: PgPool, handlers: Handlers) -> Result<Self, ConfigError> {
        config.validate()?;
        let bindings = if config.bindings.is_empty() {
            handlers.default_bindings()
        } else {
            config.bindings.clone()
        };
        if bindings.is_empty() {
            return Err(ConfigError::NoBindings);
        }
        let topology = Topology::new(&config.name, &config.retry_delays);
        Ok(Self {
            ctx: Arc::new(Ctx {
                config,
                pool,
                handlers,
                topology,
                bindings,
                stats: Arc::new(Stats::default()),
                readiness: Readiness::new(),
            }),
        })
    }

    /// Counters of what this consumer did (the same counts as its metrics).
    pub fn stats(&self) -> Arc<Stats> {
        self.ctx.stats.clone()
    }

    /// The readiness `/readyz` reports, to merge into an embedding service's own health.
    pub fn readiness(&self) -> Arc<Readiness> {
        self.ctx.readiness.clone()
    }

    /// The names of this consumer's queues and exchanges.
    pub fn topology(&self) -> &Topology {
        &self.ctx.topology
    }

    /// The binding keys the queue gets.
    pub fn bindings(&self) -> &[String] {
        &self.ctx.bindings
    }

    /// Consumes until `shutdown` is cancelled, then finishes in-flight batches (commit, then ack)
    /// and returns `Ok`. Lost connections to RabbitMQ or PostgreSQL are retried with backoff.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ConsumerError> {
        let ctx = self.ctx;
        let cfg = &ctx.config;
        let background = CancellationToken::new();
        if let Some(addr) = cfg.metrics_addr {
            plumbing::telemetry::serve_ops(addr, ctx.readiness.clone(), background.clone())
                .await
                .map_err(|source| ConsumerError::Ops { addr, source })?;
        }
        if usize::from(cfg.prefetch) < cfg.batch_size {
            tracing::warn!(
                prefetch = cfg.prefetch,
                batch_size = cfg.batch_size,
                "prefetch is below the batch size: batches can never fill"
            );
        }
        // After serve_ops: the handles must come from the installed recorder.
        let events = Events::new(&cfg.name, ctx.stats.clone());
        ctx.readiness.set_postgres(ping(&ctx.pool).await);

        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(crate::retention::run_periodically(
            ctx.pool.clone(),
            cfg.clone(),
            events.clone(),
            background.clone(),
        ));
        tasks.spawn(watch_database(
            ctx.pool.clone(),
            ctx.readiness.clone(),
            background.clone(),
        ));

        tracing::info!(
            consumer = %cfg.name,
            queue = %ctx.topology.queue,
            bindings = ?ctx.bindings,
            workers = cfg.workers,
            batch_size = cfg.batch_size,
            "consumer starting"
        );
        let mut attempt = 0u32;
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            let established = AtomicBool::new(false);
            let result = session(&ctx, &events, &shutdown, &established).await;
            ctx.readiness.set_rabbitmq(false);
            let Err(e) = result else { break };
            if shutdown.is_cancelled() {
                tracing::warn!(error = %ErrorChain(&e), "RabbitMQ session ended during shutdown");
                break;
            }
            if established.load(Ordering::Relaxed) {
                attempt = 0;
            }
            attempt += 1;
            events.reconnect();
            let delay = plumbing::backoff::delay(
                attempt,
                Duration::from_millis(200),
                Duration::from_secs(10),
            );
            tracing::warn!(error = %ErrorChain(&e), ?delay, attempt, "RabbitMQ session ended, reconnecting");
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(delay) => {}
            }
        }
        background.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        tracing::info!(consumer = %cfg.name, "consumer stopped");
        Ok(())
    }
}

/// Builds a [`Consumer`] and runs it until `shutdown`.
pub async fn run(
    config: Config,
    pool: PgPool,
    handlers: Handlers,
    shutdown: CancellationToken,
) -> Result<(), ConsumerError> {
    Consumer::new(config, pool, handlers)?.run(shutdown).await
}

async fn ping(pool: &PgPool) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::query("SELECT 1").execute(pool)
        )
        .await,
        Ok(Ok(_))
    )
}

async fn watch_database(pool: PgPool, readiness: Arc<Readiness>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        readiness.set_postgres(ping(&pool).await);
    }
}

async fn bounded<T, E>(
    what: &'static str,
    fut: impl Future<Output = Result<T, E>>,
    wrap: impl FnOnce(E) -> SessionError,
) -> Result<T, SessionError> {
    match tokio::time::timeout(BROKER_TIMEOUT, fut).await {
        Ok(r) => r.map_err(wrap),
        Err(_) => Err(SessionError::Timeout(what, BROKER_TIMEOUT)),
    }
}

/// One connection to RabbitMQ: declare, consume with `workers` workers until shutdown or failure.
async fn session(
    ctx: &Arc<Ctx>,
    events: &Events,
    shutdown: &CancellationToken,
    established: &AtomicBool,
) -> Result<(), SessionError> {
    let conn = plumbing::amqp_nodes::connect(
        &ctx.config.amqp_url,
        &ctx.config.amqp_tls,
        &format!("consumer {}", ctx.config.name),
    )
    .await?;
    let result = consume(ctx, events, &conn, shutdown, established).await;
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        conn.close(200, "consumer stopping".into()),
    )
    .await;
    result
}

async fn consume(
    ctx: &Arc<Ctx>,
    events: &Events,
    conn: &Connection,
    shutdown: &CancellationToken,
    established: &AtomicBool,
) -> Result<(), SessionError> {
    let cfg = &ctx.config;
    bounded(
        "declaring the topology",
        ctx.topology.declare(conn, &cfg.exchange, &ctx.bindings),
        SessionError::Topology,
    )
    .await?;
    let mut workers = Vec::with_capacity(cfg.workers);
    for index in 0..cfg.workers {
        workers.push(
            bounded(
                "opening a worker",
                Worker::open(ctx.clone(), events.clone(), conn, index),
                SessionError::Channel,
            )
            .await?,
        );
    }
    ctx.readiness.set_rabbitmq(true);
    established.store(true, Ordering::Relaxed);
    tracing::info!(consumer = %cfg.name, queue = %ctx.topology.queue, "consuming");

    let stop = shutdown.child_token();
    let mut set = tokio::task::JoinSet::new();
    for w in workers {
        set.spawn(w.run(stop.clone()));
    }
    let mut first_error = None;
    while let Some(joined) = set.join_next().await {
        if let Err(e) = joined.map_err(SessionError::Worker).and_then(|r| r) {
            stop.cancel();
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// What to do with a delivery, decided before the transaction.
enum Work {
    Handle(Box<Envelope>, Arc<dyn DynHandler>),
    Reject(DeadLetterKind, String),
    Ignore,
}

struct Item {
    delivery: Delivery,
    attempt: u32,
    work: Work,
}

/// How a delivery ends.
#[derive(Debug, Clone)]
enum Fate {
    Processed,
    Duplicate,
    Ignored,
    Retry(String),
    DeadLetter(DeadLetterKind, String),
}

/// A failed handler run: either the message's problem or the infrastructure's.
enum Failure {
    Message { permanent: bool, reason: String },
    Infrastructure(sqlx::Error),
}

enum TxOutcome {
    Committed(Vec<Option<Fate>>),
    /// A handler failed in an optimistic (savepoint-free) run: re-run with savepoints.
    NeedsSavepoints,
}

enum BatchEnd {
    Settled,
    /// Shutdown while the database was unavailable: left unacknowledged, the broker redelivers.
    Abandoned,
}

struct Worker {
    ctx: Arc<Ctx>,
    events: Events,
    index: usize,
    consume_ch: Channel,
    publish_ch: Channel,
    consumer: lapin::Consumer,
}

impl Worker {
    async fn open(
        ctx: Arc<Ctx>,
        events: Events,
        conn: &Connection,
        index: usize,
    ) -> Result<Self, lapin::Error> {
        let consume_ch = conn.create_channel().await?;
        consume_ch
            .basic_qos(ctx.config.prefetch, BasicQosOptions::default())
            .await?;
        let publish_ch = conn.create_channel().await?;
        publish_ch
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let tag = format!(
            "{}.{}.{}.{}",
            ctx.config.name,
            std::process::id(),
            index,
            &Uuid::new_v4().simple().to_string()[..8]
        );
        let consumer = consume_ch
            .basic_consume(
                ctx.topology.queue.as_str().into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Self {
            ctx,
            events,
            index,
            consume_ch,
            publish_ch,
            consumer,
        })
    }

    async fn run(mut self, stop: CancellationToken) -> Result<(), SessionError> {
        let result = self.consume_loop(&stop).await;
        if let Err(e) = &result {
            tracing::debug!(worker = self.index, error = %ErrorChain(e), "worker stopping");
        }
        // Closing returns every unacknowledged delivery (prefetched, never committed) to the queue.
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.consume_ch.close(200, "worker stopping".into()),
        )
        .await;
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.publish_ch.close(200, "worker stopping".into()),
        )
        .await;
        result
    }

    async fn consume_loop(&mut self, stop: &CancellationToken) -> Result<(), SessionError> {
        let batch_size = self.ctx.config.batch_size;
        loop {
            let next = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(()),
                next = self.consumer.next() => next,
            };
            let first = match next {
                None => return Err(SessionError::ConsumerCancelled),
                Some(Err(e)) => return Err(SessionError::Delivery(e)),
                Some(Ok(d)) => d,
            };
            let started = Instant::now();
            let mut batch = vec![first];
            // Take what is already buffered, without waiting: batches grow with the load.
            while batch.len() < batch_size {
                match self.consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => batch.push(d),
                    Some(Some(Err(e))) => return Err(SessionError::Delivery(e)),
                    Some(None) => return Err(SessionError::ConsumerCancelled),
                    None => break,
                }
            }
            if let BatchEnd::Abandoned = self.process_batch(batch, started, stop).await? {
                return Ok(());
            }
        }
    }

    fn prepare(&self, delivery: Delivery) -> Item {
        let attempt = message::attempt(&delivery.properties);
        let work = match message::decode(
            &delivery.properties,
            delivery.routing_key.as_str(),
            &delivery.data,
        ) {
            Err(reason) => Work::Reject(DeadLetterKind::Undecodable, reason),
            Ok(env) => match self.ctx.handlers.resolve(&env.event_type) {
                Some(h) => Work::Handle(Box::new(env), h.clone()),
                None if self.ctx.config.strict => Work::Reject(
                    DeadLetterKind::UnknownEventType,
                    format!("no handler for event type {:?}", env.event_type),
                ),
                None => Work::Ignore,
            },
        };
        Item {
            delivery,
            attempt,
            work,
        }
    }

    async fn process_batch(
        &mut self,
        deliveries: Vec<Delivery>,
        started: Instant,
        stop: &CancellationToken,
    ) -> Result<BatchEnd, SessionError> {
        let size = deliveries.len();
        let last_tag = deliveries.iter().map(|d| d.delivery_tag).max().unwrap_or(0);
        let items: Vec<Item> = deliveries.into_iter().map(|d| self.prepare(d)).collect();

        let mut fates: Vec<Option<Fate>> = vec![None; items.len()];
        if items.iter().any(|i| matches!(i.work, Work::Handle(..))) {
            let mut failures = 0u32;
            loop {
                match self.transact(&items).await {
                    Ok(f) => {
                        fates = f;
                        self.ctx.readiness.set_postgres(true);
                        break;
                    }
                    Err(e) => {
                        failures += 1;
                        self.events.database_failure();
                        self.ctx.readiness.set_postgres(false);
                        let delay = plumbing::backoff::delay(
                            failures,
                            Duration::from_millis(100),
                            Duration::from_secs(5),
                        );
                        tracing::warn!(
                            worker = self.index,
                            error = %ErrorChain(&e),
                            ?delay,
                            batch = size,
                            "batch rolled back by a database failure, retrying it (deliveries stay unacknowledged)"
                        );
                        tokio::select! {
                            _ = stop.cancelled() => {
                                tracing::info!(worker = self.index, batch = size, "stopping with the database unavailable: leaving the batch to redelivery");
                                return Ok(BatchEnd::Abandoned);
                            }
                            _ = tokio::time::sleep(delay) => {}
                        }
                        if !self.consume_ch.status().connected() {
                            return Err(SessionError::ChannelClosed);
                        }
                    }
                }
            }
            let now = chrono::Utc::now();
            for (item, fate) in items.iter().zip(&fates) {
                if let (Some(Fate::Processed), Work::Handle(env, _)) = (fate, &item.work)
                    && let Some(created) = env.created_at
                {
                    self.events
                        .committed((now - created).to_std().unwrap_or_default());
                }
            }
        }
        for (item, fate) in items.iter().zip(fates.iter_mut()) {
            if fate.is_none() {
                *fate = Some(match &item.work {
                    Work::Reject(kind, reason) => {
                        let d = &item.delivery;
                        tracing::warn!(
                            message_id = d.properties.message_id().as_ref().map_or("", |s| s.as_str()),
                            routing_key = %d.routing_key,
                            kind = kind.as_str(),
                            %reason,
                            "dead-lettering a message that cannot be handled"
                        );
                        Fate::DeadLetter(*kind, reason.clone())
                    }
                    Work::Ignore => Fate::Ignored,
                    Work::Handle(..) => {
                        unreachable!("the transaction decides every handled message")
                    }
                });
            }
        }
        let processed = fates
            .iter()
            .filter(|f| matches!(f, Some(Fate::Processed)))
            .count();
        self.events.messages(Outcome::Processed, processed as u64);

        if !self.ctx.config.ack_delay.is_zero() {
            tokio::time::sleep(self.ctx.config.ack_delay).await;
        }
        self.publish_copies(&items, &fates).await?;
        bounded(
            "acknowledging",
            self.consume_ch
                .basic_ack(last_tag, BasicAckOptions { multiple: true }),
            SessionError::Ack,
        )
        .await?;

        let mut counts = [0u64; 5];
        for fate in fates.iter().flatten() {
            let outcome = match fate {
                Fate::Processed => continue,
                Fate::Duplicate => Outcome::Duplicate,
                Fate::Ignored => Outcome::Ignored,
                Fate::Retry(_) => Outcome::Retried,
                Fate::DeadLetter(kind, _) => {
                    self.events.dead_letter(*kind);
                    Outcome::DeadLettered
                }
            };
            counts[Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0)] += 1;
        }
        for (outcome, n) in Outcome::ALL.iter().zip(counts) {
            self.events.messages(*outcome, n);
        }
        self.events.batch(size, started.elapsed());
        Ok(BatchEnd::Settled)
    }

    /// Runs the batch's handlers in one transaction: optimistically first, with a savepoint per
    /// message when a handler failed. Errors are infrastructure failures of the whole batch.
    async fn transact(&self, items: &[Item]) -> Result<Vec<Option<Fate>>, sqlx::Error> {
        if let TxOutcome::Committed(f) = self.try_transaction(items, false).await? {
            return Ok(f);
        }
        match self.try_transaction(items, true).await? {
            TxOutcome::Committed(f) => Ok(f),
            TxOutcome::NeedsSavepoints => {
                unreachable!("a run with savepoints settles every message")
            }
        }
    }

    async fn try_transaction(
        &self,
        items: &[Item],
        savepoints: bool,
    ) -> Result<TxOutcome, sqlx::Error> {
        let name = self.ctx.config.name.as_str();
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

        let mut tx = self.ctx.pool.begin().await?;
        let fresh = dedup::claim(&mut tx, &self.ctx.config.schema, name, &ids).await?;
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

        if !savepoints {
            // One handler call per run of consecutive messages with the same handler.
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
                match self
                    .run_handler(&mut tx, &envs, run[0].2)
                    .instrument(span)
                    .await
                {
                    Ok(()) => {
                        for (i, _, _) in run {
                            fates[*i] = Some(Fate::Processed);
                        }
                    }
                    Err(Failure::Infrastructure(e)) => return Err(e),
                    Err(Failure::Message { reason, .. }) => {
                        tracing::debug!(%reason, messages = run.len(), "handler failed, re-running the batch with a savepoint per message");
                        tx.rollback().await?;
                        return Ok(TxOutcome::NeedsSavepoints);
                    }
                }
            }
            // A handler that swallowed a query error leaves the transaction aborted, and COMMIT
            // would then silently roll back: check, and find the culprit with savepoints.
            if let Err(e) = sqlx::query("SELECT 1").execute(&mut *tx).await {
                if dedup::is_infrastructure(&e) {
                    return Err(e);
                }
                tx.rollback().await?;
                return Ok(TxOutcome::NeedsSavepoints);
            }
            tx.commit().await?;
            return Ok(TxOutcome::Committed(fates));
        }

        let mut failed: Vec<Uuid> = Vec::new();
        for (i, env, handler) in order {
            let attempt = items[i].attempt;
            let span = message_span(env, attempt);
            sqlx::query("SAVEPOINT consumer_message")
                .execute(&mut *tx)
                .await?;
            let mut result = self
                .run_handler(&mut tx, &[env], handler)
                .instrument(span.clone())
                .await;
            if result.is_ok() {
                // Also catches a handler that swallowed a query error and left the transaction aborted.
                if let Err(e) = sqlx::query("RELEASE SAVEPOINT consumer_message")
                    .execute(&mut *tx)
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
                Err(Failure::Message { permanent, reason }) => {
                    sqlx::query("ROLLBACK TO SAVEPOINT consumer_message")
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query("RELEASE SAVEPOINT consumer_message")
                        .execute(&mut *tx)
                        .await?;
                    failed.push(env.message_id);
                    let fate = self.fate_of_failure(permanent, reason, attempt);
                    span.in_scope(|| match &fate {
                        Fate::Retry(reason) => tracing::warn!(%reason, "handler failed, will retry"),
                        Fate::DeadLetter(kind, reason) => {
                            tracing::warn!(kind = kind.as_str(), %reason, "handler failed, dead-lettering")
                        }
                        _ => {}
                    });
                    fates[i] = Some(fate);
                }
            }
        }
        dedup::unclaim(&mut tx, &self.ctx.config.schema, name, &failed).await?;
        tx.commit().await?;
        Ok(TxOutcome::Committed(fates))
    }

    /// One handler call: a single message (`handle`) or several (`handle_batch`), bounded by the
    /// handler timeout, a panic caught and counted as a permanent failure.
    async fn run_handler(
        &self,
        conn: &mut PgConnection,
        envs: &[&Envelope],
        handler: &Arc<dyn DynHandler>,
    ) -> Result<(), Failure> {
        let timeout = self.ctx.config.handler_timeout;
        let start = Instant::now();
        let call = match envs {
            [one] => handler.call(conn, one),
            many => handler.call_batch(conn, many),
        };
        let result = tokio::time::timeout(timeout, AssertUnwindSafe(call).catch_unwind()).await;
        self.events.handler_finished(start.elapsed());
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
            Ok(Ok(Err(e))) => Err(Failure::Message {
                permanent: matches!(e, HandlerError::Permanent(_)),
                reason: ErrorChain(&e).to_string(),
            }),
        }
    }

    fn fate_of_failure(&self, permanent: bool, reason: String, attempt: u32) -> Fate {
        if permanent {
            Fate::DeadLetter(DeadLetterKind::Permanent, reason)
        } else if attempt >= self.ctx.config.max_attempts {
            Fate::DeadLetter(
                DeadLetterKind::Exhausted,
                format!("gave up after {attempt} attempt(s): {reason}"),
            )
        } else {
            Fate::Retry(reason)
        }
    }

    /// Publishes the retry copies and dead letters of this batch and waits for the broker's
    /// confirms, so that the multi-ack that follows loses nothing.
    async fn publish_copies(
        &self,
        items: &[Item],
        fates: &[Option<Fate>],
    ) -> Result<(), SessionError> {
        let mut pending: Vec<(PublisherConfirm, String)> = Vec::new();
        for (item, fate) in items.iter().zip(fates) {
            let d = &item.delivery;
            let original_key = message::original_routing_key(&d.properties, d.routing_key.as_str());
            let mut table = d.properties.headers().clone().unwrap_or_default();
            message::set_text(&mut table, headers::ORIGINAL_ROUTING_KEY, &original_key);
            let (exchange, routing_key) = match fate {
                Some(Fate::Retry(reason)) => {
                    let delay = self.ctx.config.retry_delay(item.attempt);
                    let queue = self
                        .ctx
                        .topology
                        .retry_queue(delay)
                        .unwrap_or(&self.ctx.topology.queue);
                    message::set_int(&mut table, headers::ATTEMPT, i64::from(item.attempt) + 1);
                    message::set_text(
                        &mut table,
                        headers::LAST_ERROR,
                        &message::truncate(reason, 1000),
                    );
                    (String::new(), queue.to_string())
                }
                Some(Fate::DeadLetter(kind, reason)) => {
                    message::set_int(&mut table, headers::ATTEMPT, i64::from(item.attempt));
                    message::set_text(&mut table, headers::DEAD_LETTER_KIND, kind.as_str());
                    message::set_text(
                        &mut table,
                        headers::DEAD_LETTER_REASON,
                        &message::truncate(reason, 2000),
                    );
                    message::set_text(
                        &mut table,
                        headers::DEAD_LETTERED_AT,
                        &chrono::Utc::now().to_rfc3339(),
                    );
                    message::set_text(
                        &mut table,
                        headers::DEAD_LETTER_CONSUMER,
                        &self.ctx.config.name,
                    );
                    (self.ctx.topology.dead_letter_exchange.clone(), original_key)
                }
                _ => continue,
            };
            let props: BasicProperties = d
                .properties
                .clone()
                .with_headers(table)
                .with_delivery_mode(2);
            let confirm = self
                .publish_ch
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &d.data,
                    props,
                )
                .await
                .map_err(SessionError::Publish)?;
            let what = format!(
                "{} of {}",
                if exchange.is_empty() {
                    "retry"
                } else {
                    "dead letter"
                },
                d.properties
                    .message_id()
                    .as_ref()
                    .map_or("(no message id)", |s| s.as_str())
            );
            pending.push((confirm, what));
        }
        let deadline = tokio::time::Instant::now() + BROKER_TIMEOUT;
        for (confirm, what) in pending {
            let confirmation = tokio::time::timeout_at(deadline, confirm)
                .await
                .map_err(|_| SessionError::Timeout("publisher confirm", BROKER_TIMEOUT))?
                .map_err(SessionError::Publish)?;
            if !confirmation.is_ack() {
                return Err(SessionError::NotConfirmed(format!("{what}: nacked")));
            }
            if let Some(returned) = confirmation.take_message() {
                return Err(SessionError::NotConfirmed(format!(
                    "{what}: returned ({})",
                    returned.reply_text
                )));
            }
        }
        Ok(())
    }
}

/// The span every log line about one message carries.
fn message_span(env: &Envelope, attempt: u32) -> tracing::Span {
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

fn classify_db(e: sqlx::Error, context: &str) -> Failure {
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
