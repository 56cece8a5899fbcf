//! The supervisor: connects to RabbitMQ, declares the topology, runs the workers of one session,
//! and reconnects with backoff when the session ends; meanwhile it reports readiness and watches
//! the database.
//!
//! What a worker does with its deliveries is in [`crate::worker`] (buffering, one batch at a time,
//! acknowledgement), [`crate::batch`] (the transaction and each message's fate) and
//! [`crate::copies`] (retry copies and dead letters).

use crate::config::Config;
use crate::context::{Ctx, bounded};
use crate::error::{ConfigError, ConsumerError, SessionError};
use crate::handler::Handlers;
use crate::internal_events::{Events, Stats};
use crate::links::Links;
use crate::topology::Topology;
use crate::worker::Worker;
use plumbing::telemetry::{ErrorChain, Readiness};
use sqlx::PgPool;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A configured consumer, ready to [`run`](Consumer::run).
pub struct Consumer {
    ctx: Arc<Ctx>,
}

impl Consumer {
    /// Validates the configuration. `pool` should allow [`Config::pool_size`] connections.
    pub fn new(config: Config, pool: PgPool, handlers: Handlers) -> Result<Self, ConfigError> {
        config.validate()?;
        let bindings = if !config.bindings.is_empty() {
            config.bindings.clone()
        } else if config.ordered {
            // Ordered mode binds whole aggregate types: all of them unless named.
            vec!["#".to_string()]
        } else {
            handlers.default_bindings()
        };
        if bindings.is_empty() {
            return Err(ConfigError::NoBindings);
        }
        if !config.ordered && config.retry_delays.is_empty() && handlers.needs_dependencies() {
            return Err(ConfigError::DependencyWithoutRetryQueues);
        }
        // Ordered mode retries in place (held, see crate::ordered): no retry queues.
        let retry_delays: &[Duration] = if config.ordered {
            &[]
        } else {
            &config.retry_delays
        };
        let mut topology = Topology::new(&config.name, retry_delays);
        if let Some(share) = &config.fair_share {
            topology.lanes = share.all_lanes(&config.name);
        }
        let fairness = config.fair_share.clone();
        Ok(Self {
            ctx: Arc::new(Ctx {
                fairness,
                config,
                breaker_pool: sqlx::postgres::PgPoolOptions::new()
                    .max_connections(2)
                    .connect_lazy_with(pool.connect_options().as_ref().clone()),
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
    /// and returns `Ok`; a batch whose database stopped answering is left unacknowledged instead
    /// (redelivered, deduplicated). Lost connections to RabbitMQ or PostgreSQL are retried with
    /// backoff.
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
        tasks.spawn(watch_database(ctx.clone(), background.clone()));

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
        // Our own pool (the caller's pool is the caller's to close).
        ctx.breaker_pool.close().await;
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
            sqlx::raw_sql("SELECT 1").execute(pool)
        )
        .await,
        Ok(Ok(_))
    )
}

/// Every 5 s: whether PostgreSQL answers (readiness), and the gauges of the handlers'
/// dependencies (circuit, slots, tokens).
async fn watch_database(ctx: Arc<Ctx>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        ctx.readiness.set_postgres(ping(&ctx.pool).await);
        for dep in ctx.handlers.dependencies() {
            if let Err(e) = dep.report(&ctx.breaker_pool, &ctx.config.schema).await {
                tracing::debug!(dependency = %dep.name(), error = %e, "dependency gauges not refreshed");
            }
        }
    }
}

/// One session on RabbitMQ (its two connections, see [`Links`]): declare, consume with `workers`
/// workers until shutdown or failure.
async fn session(
    ctx: &Arc<Ctx>,
    events: &Events,
    shutdown: &CancellationToken,
    established: &AtomicBool,
) -> Result<(), SessionError> {
    let links = Links::open(
        &ctx.config.amqp_url,
        &ctx.config.amqp_tls,
        &format!("consumer {}", ctx.config.name),
    )
    .await?;
    let result = consume(ctx, events, &links, shutdown, established).await;
    links.close().await;
    result
}

async fn consume(
    ctx: &Arc<Ctx>,
    events: &Events,
    links: &Links,
    shutdown: &CancellationToken,
    established: &AtomicBool,
) -> Result<(), SessionError> {
    let cfg = &ctx.config;
    if cfg.ordered {
        return crate::ordered::runner::consume(ctx, events, links, shutdown, established).await;
    }
    let conn = &links.consume;
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
                Worker::open(ctx.clone(), events.clone(), links, index, None, None),
                SessionError::Channel,
            )
            .await?,
        );
    }
    // A fair share's lanes, each worked by its own workers (see crate::fair).
    for lane in &ctx.topology.lanes {
        for _ in 0..lane.workers {
            let index = workers.len();
            workers.push(
                bounded(
                    "opening a lane's worker",
                    Worker::open(
                        ctx.clone(),
                        events.clone(),
                        links,
                        index,
                        None,
                        Some(lane.queue.clone()),
                    ),
                    SessionError::Channel,
                )
                .await?,
            );
        }
    }
    ctx.readiness.set_rabbitmq(true);
    established.store(true, Ordering::Relaxed);
    let broker = plumbing::broker_version::BrokerVersion::of(conn);
    tracing::info!(
        consumer = %cfg.name,
        queue = %ctx.topology.queue,
        broker = %broker.map_or_else(|| "unknown".to_string(), |v| v.to_string()),
        consumer_timeout = ?crate::worker::consume_arguments(cfg, broker).inner().get("x-consumer-timeout"),
        "consuming"
    );

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
