//! One RabbitMQ session of an ordered consumer: declare, then every quarter lease a heartbeat
//! (see [`super::group`]) and a worker per partition held, started when a partition is taken and
//! stopped (gracefully: its buffered deliveries go back to the queue) before it is given back.

use super::group::{self, Slot};
use super::topology;
use crate::context::{Ctx, bounded};
use crate::error::SessionError;
use crate::internal_events::Events;
use crate::links::Links;
use crate::worker::Worker;
use lapin::Connection;
use plumbing::telemetry::ErrorChain;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

struct Running {
    slot: Slot,
    stop: CancellationToken,
    task: JoinHandle<Result<(), SessionError>>,
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

pub(crate) async fn consume(
    ctx: &Arc<Ctx>,
    events: &Events,
    links: &Links,
    shutdown: &CancellationToken,
    established: &AtomicBool,
) -> Result<(), SessionError> {
    join(ctx, &links.consume, established).await?;
    let cfg = &ctx.config;
    let mut running: BTreeMap<i16, Running> = BTreeMap::new();
    let mut last_stuck = (0, 0);
    let mut renewed_at = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(cfg.lease / 4);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            _ = tick.tick() => {}
        }
        reap_ended(&mut running).await;
        if !links.connected() {
            break Err(SessionError::ChannelClosed);
        }
        let Some(held) = renew(ctx, &mut running, &mut renewed_at).await else {
            continue;
        };
        stop_lost(&held, &mut running).await;
        let surplus = give_back_surplus(ctx, &held, &mut running).await;
        // New: start a worker each.
        for (p, slot) in &held.slots {
            if !surplus.contains(p) && !running.contains_key(p) {
                start_worker(ctx, events, links, shutdown, (*p, *slot), &mut running).await;
            }
        }
        crate::internal_events::owned_partitions(&cfg.name, running.len());
        report_stuck(ctx, &mut last_stuck).await;
    };
    leave(ctx, running, shutdown).await;
    result
}

/// Declares the topology and the partition queues and makes sure the group's partitions exist:
/// the session is established.
async fn join(ctx: &Ctx, conn: &Connection, established: &AtomicBool) -> Result<(), SessionError> {
    let cfg = &ctx.config;
    // The dead-letter exchange and queue (undecodable deliveries); the plain queue stays unbound.
    bounded(
        "declaring the topology",
        ctx.topology.declare(conn, &cfg.exchange, &[]),
        SessionError::Topology,
    )
    .await?;
    bounded(
        "declaring the partition queues",
        topology::declare(
            conn,
            &cfg.exchange,
            &cfg.name,
            cfg.partitions,
            &ctx.bindings,
        ),
        SessionError::Topology,
    )
    .await?;
    group::ensure(&ctx.pool, &cfg.schema, &cfg.name, cfg.partitions)
        .await
        .map_err(SessionError::Group)?;
    ctx.readiness.set_rabbitmq(true);
    established.store(true, Ordering::Relaxed);
    tracing::info!(consumer = %cfg.name, instance = %cfg.instance_id, partitions = cfg.partitions, "ordered consumer joining its group");
    Ok(())
}

/// Workers that ended: fenced (the partition moved), or their channel failed.
async fn reap_ended(running: &mut BTreeMap<i16, Running>) {
    let ended: Vec<i16> = running
        .iter()
        .filter(|(_, r)| r.task.is_finished())
        .map(|(p, _)| *p)
        .collect();
    for p in ended {
        if let Some(r) = running.remove(&p) {
            match r.task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(partition = p, error = %ErrorChain(&e), "partition worker ended")
                }
                Err(e) => tracing::warn!(partition = p, error = %e, "partition worker failed"),
            }
        }
    }
}

/// The heartbeat: renews the leases and says which partitions this instance holds (`None`: the
/// renewal failed).
///
/// The leases this instance renewed last end, at the latest, a lease after that renewal began.
/// Once that passed without a renewal, another instance may have taken the partitions, and on a
/// single-active-consumer queue its consumer receives nothing while ours stays subscribed: the
/// workers stop then, even while the renewal still hangs (the fence already keeps them from
/// applying anything).
async fn renew(
    ctx: &Ctx,
    running: &mut BTreeMap<i16, Running>,
    renewed_at: &mut tokio::time::Instant,
) -> Option<group::Held> {
    let cfg = &ctx.config;
    let began = tokio::time::Instant::now();
    let tick = plumbing::db::bounded(group::tick(
        &ctx.pool,
        &cfg.schema,
        &cfg.name,
        &cfg.instance_id,
        cfg.partitions,
        cfg.lease,
    ));
    tokio::pin!(tick);
    let renewal = tokio::select! {
        r = &mut tick => r,
        _ = tokio::time::sleep_until(*renewed_at + cfg.lease), if !running.is_empty() => {
            stop_unrenewed(ctx, running).await;
            tick.await
        }
    };
    match renewal {
        Ok(h) => {
            *renewed_at = began;
            ctx.readiness.set_postgres(true);
            Some(h)
        }
        Err(e) => {
            ctx.readiness.set_postgres(false);
            tracing::warn!(error = %ErrorChain(&e), "partition lease renewal failed; the fence stops every apply once a lease ends");
            None
        }
    }
}

/// Lost (taken over after a pause) or moved to another epoch: their workers stop.
async fn stop_lost(held: &group::Held, running: &mut BTreeMap<i16, Running>) {
    let lost: Vec<i16> = running
        .iter()
        .filter(|(p, r)| held.slots.get(p) != Some(&r.slot))
        .map(|(p, _)| *p)
        .collect();
    for p in lost {
        if let Some(r) = running.remove(&p) {
            tracing::warn!(partition = p, "partition lost; its worker stops");
            r.stop().await;
        }
    }
}

/// Surplus (someone joined): stops the highest ones' workers, then gives them back; returns them.
async fn give_back_surplus(
    ctx: &Ctx,
    held: &group::Held,
    running: &mut BTreeMap<i16, Running>,
) -> Vec<i16> {
    let cfg = &ctx.config;
    let surplus: Vec<i16> = held
        .slots
        .keys()
        .rev()
        .take(held.surplus)
        .copied()
        .collect();
    if surplus.is_empty() {
        return surplus;
    }
    for p in &surplus {
        if let Some(r) = running.remove(p) {
            r.stop().await;
        }
    }
    match plumbing::db::bounded(group::release(
        &ctx.pool,
        &cfg.schema,
        &cfg.name,
        &cfg.instance_id,
        &surplus,
    ))
    .await
    {
        Ok(()) => {
            tracing::info!(partitions = ?surplus, "gave partitions back for rebalancing")
        }
        Err(e) => {
            tracing::warn!(error = %ErrorChain(&e), "giving partitions back failed; they move when their lease ends")
        }
    }
    surplus
}

/// Opens a worker for partition `p` held in `slot` and runs it (a failure to open is tried again
/// at the next heartbeat).
async fn start_worker(
    ctx: &Arc<Ctx>,
    events: &Events,
    links: &Links,
    shutdown: &CancellationToken,
    (p, slot): (i16, Slot),
    running: &mut BTreeMap<i16, Running>,
) {
    let worker = bounded(
        "opening a partition worker",
        Worker::open(
            ctx.clone(),
            events.clone(),
            links,
            p as usize,
            Some(slot),
            None,
        ),
        SessionError::Channel,
    )
    .await;
    match worker {
        Ok(w) => {
            let stop = shutdown.child_token();
            tracing::info!(partition = p, epoch = slot.epoch, "consuming partition");
            running.insert(
                p,
                Running {
                    slot,
                    stop: stop.clone(),
                    task: tokio::spawn(w.run(stop)),
                },
            );
        }
        Err(e) => {
            tracing::warn!(partition = p, error = %ErrorChain(&e), "could not open a partition worker; trying again at the next heartbeat")
        }
    }
}

/// The session ends: every worker stops; on shutdown the partitions are handed over at once
/// instead of after the lease, and the instance leaves its group.
async fn leave(ctx: &Ctx, mut running: BTreeMap<i16, Running>, shutdown: &CancellationToken) {
    let cfg = &ctx.config;
    let partitions: Vec<i16> = running.keys().copied().collect();
    for (_, r) in std::mem::take(&mut running) {
        r.stop().await;
    }
    if shutdown.is_cancelled() {
        let _ = plumbing::db::bounded(group::release(
            &ctx.pool,
            &cfg.schema,
            &cfg.name,
            &cfg.instance_id,
            &partitions,
        ))
        .await;
        let _ = plumbing::db::bounded(group::leave(
            &ctx.pool,
            &cfg.schema,
            &cfg.name,
            &cfg.instance_id,
        ))
        .await;
        crate::internal_events::owned_partitions(&cfg.name, 0);
    }
}

/// Stops every partition worker after the leases ended unrenewed (PostgreSQL unreachable): their
/// queues' deliveries go back to the broker for the instances that take the partitions over.
async fn stop_unrenewed(ctx: &Ctx, running: &mut BTreeMap<i16, Running>) {
    let cfg = &ctx.config;
    // Not renewed for a whole lease: PostgreSQL does not answer. Said before the stop, so that a
    // worker waiting on its batch's transaction leaves the batch to redelivery at once.
    ctx.readiness.set_postgres(false);
    let partitions: Vec<i16> = running.keys().copied().collect();
    tracing::warn!(
        consumer = %cfg.name,
        ?partitions,
        lease = ?cfg.lease,
        "partition leases ended without renewal (PostgreSQL unreachable): stopping their workers so that the instances taking the partitions over receive their queues"
    );
    for (_, r) in std::mem::take(running) {
        r.stop().await;
    }
    crate::internal_events::owned_partitions(&cfg.name, 0);
}

/// The gauges of parked aggregates, gap waits and held messages (the whole consumer's, as every
/// instance sees it), and a log line whenever the parked or gap-waiting count changes.
async fn report_stuck(ctx: &Ctx, last: &mut (i64, i64)) {
    let cfg = &ctx.config;
    let counts = plumbing::db::bounded(super::admin::counts(
        &ctx.pool,
        &cfg.schema,
        &cfg.name,
        cfg.gap_timeout,
    ))
    .await;
    let Ok((parked, gaps, held)) = counts else {
        return;
    };
    crate::internal_events::ordered_state(&cfg.name, parked, gaps, held);
    if (parked, gaps) != *last && (parked > 0 || gaps > 0) {
        tracing::warn!(
            consumer = %cfg.name,
            parked,
            gap_waits = gaps,
            held,
            gap_timeout = ?cfg.gap_timeout,
            "ordered consumer has stuck aggregates: parked ones wait for an operator, gap waits for a missing message (see the console, or consumer::ordered::admin::stuck)"
        );
    }
    *last = (parked, gaps);
}
