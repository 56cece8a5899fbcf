//! The relay: publishes committed outbox rows to RabbitMQ at least once, in order per aggregate,
//! with any number of instances on one database.
//!
//! A short tour:
//! - [`config`]: flags and env vars ([`RelayConfig`]).
//! - [`leases`]: which of the 64 outbox partitions this instance publishes; takeover after a crash;
//!   the renewal loop.
//! - wake-ups: [`plumbing::listen`] on a connection of the relay's own, or on the direct URL behind
//!   a transaction pooler, or nowhere without one (the poll covers the gaps).
//! - `stats`: the backlog and unrouted-queue gauges, refreshed by [`plumbing::periodic`].
//! - `retention`: purging published rows kept for `--retention-secs`.
//! - [`counters`]: purging the aggregate counters' closed rows (migration 26).
//! - [`store`]: the pipeline's SQL: claim the head of owned partitions, mark published, record
//!   failures, the backlog. The claim and the mark read their indexes whatever the outbox's statistics say
//!   (sequential scans off, migration 18) and are prepared statements on a direct session.
//! - `pipeline`: claims, publishes and marks overlapping. Its parts are plain types with their own
//!   tests: `claims` (what this relay holds, how much of each partition to ask for), `chains`
//!   (per-aggregate order with many rows of one aggregate in flight, and what a refusal in the
//!   middle of a chain gives back), `window` (confirms and what they mean), `marks`, `gate`
//!   (blocked and released partitions), `health` (readiness and backoff).
//! - [`encoder`]: the AMQP form of a row, checked (AMQP limits, reserved headers, frame and payload
//!   size) before anything is sent: a row that can never be published goes dead, never reaches lapin.
//! - [`publisher`]: the RabbitMQ connection and confirm channel.
//! - [`internal_events`]: every metric the relay emits.
//! - [`dead_rows`]: dead rows as a person reads and requeues them (`relay dead`, the console).
//! - [`aggregate`]: the retained messages of one aggregate, for a person following a link.
//! - [`verify`]: `relay verify`: reconcile what was published in a window against a consumer's
//!   `processed_messages` (missing ids, end-to-end lag).
//! - [`run`] / [`run_with_pool`]: the loop tying them together; the binary and embedding services call these.
//!
//! The flow: claim up to `batch_size` pending rows of the owned, unblocked partitions (a plain
//! read, no transaction held) -> publish them with up to `window` confirms outstanding, many of
//! one aggregate back to back in `aggregate_seq` order on one channel -> delete
//! (or mark) confirmed rows in one statement per batch -> record refusals, which block their
//! partition for the retry backoff. Claims and marks run while publishes are in flight, so the
//! broker never waits for the database; when a claim comes back empty the relay waits for a
//! NOTIFY from a producer's commit or the fallback poll.
//!
//! **Tables.** The relay owns `messages` once a producer committed a row (claim, mark, backlog:
//! [`store`]; dead rows and their requeue: [`dead_rows`]; one aggregate's rows: [`aggregate`]),
//! and `relay_partitions` and `relay_instances` (leases). It deletes the closed rows of
//! `aggregate_sequences` ([`counters`]); the numbering itself is the producers' trigger's. Other crates read and change them only
//! through these (the console lists dead rows with [`dead_rows::dead_rows`] and requeues with
//! [`dead_rows::requeue_dead_in`]).

pub mod aggregate;
pub mod cloudevents;
pub mod config;
pub mod counters;
pub mod dead;
pub mod dead_rows;
pub mod encoder;
pub mod internal_events;
pub mod leases;
mod lenient_json;
pub(crate) mod pipeline;
pub mod publisher;
mod retention;
pub mod row_state;
mod stats;
pub mod store;
pub mod verify;

pub use config::{RelayConfig, RelayOptions};

use leases::Leases;
use plumbing::telemetry::{ErrorChain, Readiness};
use publisher::Publisher;
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
    #[error("invalid configuration")]
    FrameMax(#[from] plumbing::amqp::FrameMaxTooSmall),
}

/// Runs a relay until `shutdown` is cancelled: connects (retrying while PostgreSQL starts), applies
/// migrations, serves `/metrics`, `/healthz`, `/readyz` on `METRICS_ADDR`, then publishes.
pub async fn run(config: RelayConfig, shutdown: CancellationToken) -> Result<(), RelayError> {
    validate(&config.options)?;
    plumbing::amqp::check_frame_max(&config.connections.amqp_url)?;
    let readiness = Readiness::new();
    plumbing::telemetry::serve_ops(
        config.connections.metrics_addr,
        readiness.clone(),
        shutdown.clone(),
    )
    .await
    .map_err(RelayError::Metrics)?;
    let connect = plumbing::db::connect_and_migrate_to(
        config.connections.database(),
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
    let cloudevents = config
        .options
        .cloudevents()
        .map_err(|e| RelayError::Config(e.to_string()))?
        .map(Arc::new);
    internal_events::describe();
    let opts = config.options.clone();
    let instance_id = opts
        .instance_id
        .clone()
        .unwrap_or_else(plumbing::membership::instance_id);
    let span = tracing::info_span!("relay", instance = %instance_id);
    let _enter = span.enter();
    tracing::info!(exchange = %config.connections.exchange, "relay starting");
    readiness.set_postgres(true);

    let schema = config.connections.schema.clone();
    let leases = Arc::new(Leases::new(instance_id, schema.clone(), opts.lease()));
    let wake = Arc::new(Notify::new());
    let tasks = CancellationToken::new();
    let handles = spawn_helpers(&pool, &config, &leases, &wake, &readiness, &tasks);

    let publisher = Publisher::new(
        &config.connections.amqp_url,
        &config.connections.exchange,
        opts.alternate_exchange,
    )
    .with_tls(config.connections.amqp_tls.clone());
    let mut publisher = pipeline::Pipeline::new(
        &pool,
        publisher,
        &leases,
        &wake,
        &readiness,
        &opts,
        cloudevents,
    )
    .with_statements(store::Statements::for_pooler(
        config.connections.database_pooler,
    ))
    .run(&shutdown)
    .await;

    // Safe point: nothing is in flight and everything confirmed is marked (or given up on after a
    // bounded wait). Hand the partitions over at once instead of making the others wait the lease.
    tasks.cancel();
    stop_helpers(handles, &leases, &pool).await;
    publisher.disconnect().await;
    readiness.set_postgres(false);
    readiness.set_rabbitmq(false);
    internal_events::ready(false);
    tracing::info!("relay stopped");
    Ok(())
}

/// The relay's helper tasks beside the pipeline: lease renewal, the LISTEN loop, statistics and
/// the counter purge and (if configured) retention; they stop when `tasks` is cancelled.
fn spawn_helpers(
    pool: &PgPool,
    config: &RelayConfig,
    leases: &Arc<Leases>,
    wake: &Arc<Notify>,
    readiness: &Arc<Readiness>,
    tasks: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    let opts = &config.options;
    let schema = &config.connections.schema;
    let mut handles = vec![
        tokio::spawn(leases::renew_loop(
            pool.clone(),
            leases.clone(),
            wake.clone(),
            readiness.clone(),
            opts.lease(),
            tasks.clone(),
        )),
        tokio::spawn(stats::stats_loop(
            pool.clone(),
            schema.clone(),
            opts.alternate_exchange.then(|| {
                (
                    config.connections.amqp_url.clone(),
                    config.connections.amqp_tls.clone(),
                    config.connections.exchange.clone(),
                )
            }),
            opts.stats_interval(),
            tasks.clone(),
        )),
    ];
    match plumbing::listen::ListenOn::for_target(
        config.connections.database(),
        pool,
        "outbox-relay-listen",
    ) {
        Some(on) => handles.push(tokio::spawn(plumbing::listen::wake_on_notify(
            on,
            schema.notify_channel(),
            wake.clone(),
            tasks.clone(),
        ))),
        None => tracing::info!(
            "no LISTEN: DATABASE_URL goes through a transaction pooler and DATABASE_DIRECT_URL is unset; the poll finds new rows"
        ),
    }
    handles.push(tokio::spawn(counters::purge_loop(
        pool.clone(),
        schema.clone(),
        tasks.clone(),
    )));
    if opts.retention_secs > 0 {
        handles.push(tokio::spawn(retention::retention_loop(
            pool.clone(),
            schema.clone(),
            Duration::from_secs(opts.retention_secs),
            tasks.clone(),
        )));
    }
    handles
}

/// After the helpers were told to stop: waits for them briefly, then hands the partitions over.
async fn stop_helpers(handles: Vec<tokio::task::JoinHandle<()>>, leases: &Leases, pool: &PgPool) {
    // The helpers stop at their next wait; one stuck on a silent database is not waited for.
    for mut h in handles {
        if tokio::time::timeout(Duration::from_secs(2), &mut h)
            .await
            .is_err()
        {
            h.abort();
        }
    }
    if let Err(e) = tokio::time::timeout(Duration::from_secs(5), leases.release_all(pool))
        .await
        .unwrap_or(Ok(()))
    {
        tracing::warn!(error = %ErrorChain(&e), "could not release partitions; they expire after the lease");
    }
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
