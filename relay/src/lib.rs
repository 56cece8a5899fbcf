//! The relay: publishes committed outbox rows to RabbitMQ at least once, in order per aggregate,
//! with any number of instances on one database.
//!
//! A short tour:
//! - [`config`]: flags and env vars ([`RelayConfig`]).
//! - [`leases`]: which of the 64 outbox partitions this instance publishes; takeover after a crash.
//! - [`store`]: the SQL: claim the head of owned partitions, mark published, record failures, dead rows.
//! - [`pipeline`]: claims, publishes and marks overlapping; per-aggregate chains keep the order.
//! - [`encoder`]: the AMQP form of a row, checked (AMQP limits, reserved headers, frame and payload
//!   size) before anything is sent: a row that can never be published goes dead, never reaches lapin.
//! - [`publisher`]: the RabbitMQ connection and confirm channel.
//! - [`internal_events`]: every metric the relay emits.
//! - [`run`] / [`run_with_pool`]: the loop tying them together; the binary and embedding services call these.
//!
//! The flow: claim up to `batch_size` pending rows of the owned, unblocked partitions (a plain
//! read, no transaction held) -> publish them with up to `window` confirms outstanding -> delete
//! (or mark) confirmed rows in one statement per batch -> record refusals, which block their
//! partition for the retry backoff. Claims and marks run while publishes are in flight, so the
//! broker never waits for the database; when a claim comes back empty the relay waits for a
//! NOTIFY from a producer's commit or the fallback poll.

pub mod config;
pub mod dead;
pub mod encoder;
pub mod internal_events;
pub mod leases;
pub(crate) mod pipeline;
pub mod publisher;
pub mod store;

pub use config::{RelayConfig, RelayOptions};

use leases::Leases;
use plumbing::telemetry::{ErrorChain, Readiness};
use publisher::Publisher;
use shared::schema::Schema;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Why the relay could not run.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot serve metrics")]
    Metrics(#[source] std::io::Error),
    #[error(transparent)]
    Db(#[from] plumbing::db::DbError),
}

/// Runs a relay until `shutdown` is cancelled: connects (retrying while PostgreSQL starts), applies
/// migrations, serves `/metrics`, `/healthz`, `/readyz` on `METRICS_ADDR`, then publishes.
pub async fn run(config: RelayConfig, shutdown: CancellationToken) -> Result<(), RelayError> {
    validate(&config.options)?;
    let readiness = Readiness::new();
    plumbing::telemetry::serve_ops(
        config.connections.metrics_addr,
        readiness.clone(),
        shutdown.clone(),
    )
    .await
    .map_err(RelayError::Metrics)?;
    let connect = plumbing::db::connect_and_migrate(
        &config.connections.database_url,
        config.options.db_pool_size,
        "outbox-relay",
        &config.connections.schema,
        Duration::from_secs(u64::MAX / 4),
    );
    let pool = tokio::select! {
        pool = connect => pool?,
        _ = shutdown.cancelled() => return Ok(()),
    };
    run_with_pool(pool, config, readiness, shutdown).await
}

/// Runs a relay on an existing pool (for a service that embeds the relay; migrations must have
/// been applied, e.g. with `plumbing::db::migrate`). Does not serve HTTP: merge
/// `plumbing::telemetry::ops_router(readiness)` into your own router if you want the endpoints.
pub async fn run_with_pool(
    pool: PgPool,
    config: RelayConfig,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    validate(&config.options)?;
    internal_events::describe();
    let opts = config.options.clone();
    let instance_id = opts.instance_id.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            leases::hostname(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )
    });
    let span = tracing::info_span!("relay", instance = %instance_id);
    let _enter = span.enter();
    tracing::info!(exchange = %config.connections.exchange, "relay starting");
    readiness.set_postgres(true);

    let schema = config.connections.schema.clone();
    let leases = Arc::new(Leases::new(instance_id, schema.clone(), opts.lease()));
    let wake = Arc::new(Notify::new());
    let tasks = CancellationToken::new();
    let mut handles = vec![
        tokio::spawn(lease_loop(
            pool.clone(),
            leases.clone(),
            wake.clone(),
            readiness.clone(),
            opts.lease(),
            tasks.clone(),
        )),
        tokio::spawn(listen_loop(
            pool.clone(),
            schema.notify_channel(),
            wake.clone(),
            tasks.clone(),
        )),
        tokio::spawn(stats_loop(
            pool.clone(),
            schema.clone(),
            opts.alternate_exchange.then(|| {
                (
                    config.connections.amqp_url.clone(),
                    config.connections.exchange.clone(),
                )
            }),
            opts.stats_interval(),
            tasks.clone(),
        )),
    ];
    if opts.retention_secs > 0 {
        handles.push(tokio::spawn(retention_loop(
            pool.clone(),
            schema.clone(),
            Duration::from_secs(opts.retention_secs),
            tasks.clone(),
        )));
    }

    let publisher = Publisher::new(
        &config.connections.amqp_url,
        &config.connections.exchange,
        opts.alternate_exchange,
    );
    let mut publisher =
        pipeline::Pipeline::new(&pool, publisher, &leases, &wake, &readiness, &opts)
            .run(&shutdown)
            .await;

    // Safe point: nothing is in flight and everything confirmed is marked (or given up on after a
    // bounded wait). Hand the partitions over at once instead of making the others wait the lease.
    tasks.cancel();
    // The helpers stop at their next wait; one stuck on a silent database is not waited for.
    for mut h in handles {
        if tokio::time::timeout(Duration::from_secs(2), &mut h)
            .await
            .is_err()
        {
            h.abort();
        }
    }
    if let Err(e) = tokio::time::timeout(Duration::from_secs(5), leases.release_all(&pool))
        .await
        .unwrap_or(Ok(()))
    {
        tracing::warn!(error = %ErrorChain(&e), "could not release partitions; they expire after the lease");
    }
    publisher.disconnect().await;
    readiness.set_postgres(false);
    readiness.set_rabbitmq(false);
    internal_events::ready(false);
    tracing::info!("relay stopped");
    Ok(())
}

fn validate(opts: &RelayOptions) -> Result<(), RelayError> {
    if opts.lease_ms < 2 * opts.confirm_timeout_ms {
        return Err(RelayError::Config(format!(
            "the lease ({} ms) must be at least twice the confirm timeout ({} ms)",
            opts.lease_ms, opts.confirm_timeout_ms
        )));
    }
    Ok(())
}

pub(crate) fn set_ready(readiness: &Readiness, postgres: Option<bool>, rabbitmq: Option<bool>) {
    if let Some(p) = postgres {
        readiness.set_postgres(p);
    }
    if let Some(r) = rabbitmq {
        readiness.set_rabbitmq(r);
    }
    internal_events::ready(readiness.ready());
}

async fn lease_loop(
    pool: PgPool,
    leases: Arc<Leases>,
    wake: Arc<Notify>,
    readiness: Arc<Readiness>,
    lease: Duration,
    stop: CancellationToken,
) {
    let period = lease / 4;
    loop {
        let before = leases.held_count();
        match store::bounded(leases.tick(&pool)).await {
            Ok(()) => {
                set_ready(&readiness, Some(true), None);
                if leases.held_count() > before {
                    wake.notify_one(); // new partitions may have a backlog
                }
            }
            Err(e) => {
                set_ready(&readiness, Some(false), None);
                tracing::warn!(error = %ErrorChain(&e), "lease renewal failed; partitions are used only while the local lease view lasts");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.cancelled() => return,
        }
    }
}

async fn listen_loop(pool: PgPool, channel: String, wake: Arc<Notify>, stop: CancellationToken) {
    let mut failures = 0u32;
    loop {
        let result = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
            listener.listen(&channel).await?;
            // Anything committed while we were not listening is found by this wake-up.
            wake.notify_one();
            loop {
                // A notification, or Ok(None) after a reconnect that may have dropped some:
                // either way, look at the outbox.
                listener.try_recv().await?;
                wake.notify_one();
            }
            #[allow(unreachable_code)]
            Ok::<(), sqlx::Error>(())
        };
        tokio::select! {
            r = result => {
                if let Err(e) = r {
                    failures += 1;
                    tracing::warn!(error = %ErrorChain(&e), "LISTEN connection failed; the poll covers until it is back");
                }
            }
            _ = stop.cancelled() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(plumbing::backoff::delay(failures.max(1), Duration::from_millis(200), Duration::from_secs(5))) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Refreshes the backlog gauges, and the unrouted-queue depth over a connection of its own, so
/// the publish loop never waits on these.
async fn stats_loop(
    pool: PgPool,
    schema: Schema,
    amqp: Option<(String, String)>,
    every: Duration,
    stop: CancellationToken,
) {
    let mut conn: Option<lapin::Connection> = None;
    loop {
        match store::bounded(store::backlog(&pool, &schema)).await {
            Ok(b) => internal_events::backlog(b.pending, b.oldest_age, b.dead),
            Err(e) => tracing::debug!(error = %ErrorChain(&e), "backlog query failed"),
        }
        if let Some((url, exchange)) = &amqp {
            if !conn.as_ref().is_some_and(|c| c.status().connected()) {
                conn = plumbing::amqp::connect(url, "outbox-relay-stats")
                    .await
                    .ok();
            }
            if let Some(c) = &conn
                && let Some(depth) = publisher::unrouted_depth(c, exchange).await
            {
                internal_events::unrouted(depth);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => break,
        }
    }
    if let Some(c) = conn {
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            c.close(200, "relay stopping".into()),
        )
        .await;
    }
}

async fn retention_loop(
    pool: PgPool,
    schema: Schema,
    retention: Duration,
    stop: CancellationToken,
) {
    const BATCH: i64 = 5000;
    loop {
        loop {
            match store::bounded(store::purge_published(&pool, &schema, retention, BATCH)).await {
                Ok(n) if n as i64 >= BATCH && !stop.is_cancelled() => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %ErrorChain(&e), "purging published rows failed");
                    break;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(10).min(retention)) => {}
            _ = stop.cancelled() => return,
        }
    }
}
