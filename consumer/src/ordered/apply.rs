//! The ordered apply transaction: a batch of one partition's deliveries (or, for the sweep, just
//! the aggregates whose held messages may go now) applied in each aggregate's sequence order.
//!
//! 1. `BEGIN`; the fence (see [`super::group::fence`]): not the partition's owner any more, nothing
//!    is applied and the deliveries stay unacknowledged.
//! 2. Lock the batch's aggregates' positions (`FOR UPDATE`, created at 0 when new), in key order.
//! 3. Per aggregate, [`decide::plan`]: apply what is next in line (from this batch or from the
//!    held messages), hold what is ahead of a gap or behind a waiting head, report what is stale.
//! 4. Run the handlers, consecutive messages of an aggregate in one call where they share a
//!    handler; if one fails, the transaction is rolled back and re-run with a savepoint per
//!    message, so the failing message and the rest of its aggregate are held (retried after a
//!    backoff, or parked once attempts run out), and other aggregates go on.
//! 5. Write positions, held and released rows; `COMMIT`. The caller acknowledges after.

use super::decide::{self, HeadFailure, Plan, Position};
use super::group::{self, Slot};
use super::store::{self, AggregateKey, HeadState, HeldRow, PositionUpdate};
use crate::batch::{self, Failure, Fate, Item, Work};
use crate::context::Ctx;
use crate::handler::DynHandler;
use crate::internal_events::Events;
use shared::Envelope;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tracing::Instrument;

/// Why a batch was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("this instance no longer holds partition {0} (lease lost or taken over)")]
    Fenced(i16),
    #[error("database error")]
    Db(#[from] sqlx::Error),
}

/// Most held messages one aggregate releases in one transaction (the sweep goes on after).
const RELEASE_PER_TRANSACTION: usize = 1000;

/// A message that may run now: from a delivery (its item index) or from `consumer_held`.
struct Message<'a> {
    item: Option<usize>,
    env: MessageEnv<'a>,
    handler: Option<Arc<dyn DynHandler>>,
}

enum MessageEnv<'a> {
    Arrived(&'a Envelope),
    Held(Box<Envelope>),
}

impl MessageEnv<'_> {
    fn get(&self) -> &Envelope {
        match self {
            Self::Arrived(e) => e,
            Self::Held(e) => e,
        }
    }
}

/// One aggregate's share of the batch.
struct Aggregate<'a> {
    key: AggregateKey,
    /// Arrived, by sequence number: the first delivery's item index, copies after it.
    arrived: BTreeMap<i64, Vec<usize>>,
    held: BTreeSet<i64>,
    position: Position,
    attempts: u32,
    plan: Plan,
    run: Vec<Message<'a>>,
    /// Set when a message failed in this transaction: its sequence number, what that means, the
    /// reason and its failed attempts so far.
    failure: Option<(i64, HeadFailure, String, u32)>,
}

/// Applies `items` (deliveries of partition `slot`) and releases held messages of `sweep`
/// (aggregates the sweep found ready). Returns each item's fate; `Err` rolls everything back.
pub(crate) async fn transact(
    ctx: &Ctx,
    events: &Events,
    slot: Slot,
    items: &[Item],
    sweep: &[AggregateKey],
) -> Result<Vec<Option<Fate>>, ApplyError> {
    match run(ctx, events, slot, items, sweep, false).await? {
        Some(fates) => Ok(fates),
        None => Ok(run(ctx, events, slot, items, sweep, true)
            .await?
            .expect("with savepoints a failure is recorded, not retried")),
    }
}

/// One try: `savepoints` false runs optimistically and returns `None` (rolled back) on a handler
/// failure; true isolates each message.
async fn run(
    ctx: &Ctx,
    events: &Events,
    slot: Slot,
    items: &[Item],
    sweep: &[AggregateKey],
    savepoints: bool,
) -> Result<Option<Vec<Option<Fate>>>, ApplyError> {
    let cfg = &ctx.config;
    let schema = &cfg.schema;
    let name = cfg.name.as_str();
    let mut fates: Vec<Option<Fate>> = vec![None; items.len()];
    let mut aggregates = gather(items, sweep);
    if aggregates.is_empty() {
        return Ok(Some(fates));
    }
    let mut tx = plumbing::db::bounded(ctx.pool.begin()).await?;
    if !plumbing::db::bounded(group::fence(&mut tx, schema, name, &cfg.instance_id, slot)).await? {
        let _ = tx.rollback().await;
        return Err(ApplyError::Fenced(slot.partition));
    }
    let keys: Vec<AggregateKey> = aggregates.keys().cloned().collect();
    let heads = plumbing::db::bounded(store::lock_positions(
        &mut tx,
        schema,
        name,
        slot.partition,
        &keys,
    ))
    .await?;
    let held = plumbing::db::bounded(store::held_seqs(&mut tx, schema, name, &keys)).await?;
    for (key, agg) in aggregates.iter_mut() {
        let head: HeadState = heads.get(key).copied().unwrap_or_default();
        agg.position = Position {
            applied: head.applied,
            head_waits: head.waits,
        };
        agg.attempts = head.attempts;
        agg.held = held.get(key).cloned().unwrap_or_default();
        let arrived: BTreeSet<i64> = agg.arrived.keys().copied().collect();
        agg.plan = decide::plan(agg.position, &arrived, &agg.held);
        if agg.arrived.is_empty() {
            agg.plan.apply.truncate(RELEASE_PER_TRANSACTION);
        }
    }
    // The held messages whose turn came, fetched in one statement.
    let wanted: Vec<(AggregateKey, i64)> = aggregates
        .iter()
        .flat_map(|(k, a)| {
            a.plan
                .apply
                .iter()
                .filter(|s| !a.arrived.contains_key(s))
                .map(move |s| (k.clone(), *s))
        })
        .collect();
    let mut released =
        plumbing::db::bounded(store::held_envelopes(&mut tx, schema, name, &wanted)).await?;
    for (key, agg) in aggregates.iter_mut() {
        for &seq in &agg.plan.apply {
            let message = match agg.arrived.get(&seq).and_then(|ix| ix.first()) {
                Some(&i) => arrived_message(items, i),
                None => match released.remove(&(key.clone(), seq)) {
                    Some(env) => Message {
                        item: None,
                        handler: ctx.handlers.resolve(&env.event_type).cloned(),
                        env: MessageEnv::Held(Box::new(env)),
                    },
                    // Listed but gone (released by a concurrent sweep): stop here.
                    None => break,
                },
            };
            agg.run.push(message);
        }
        agg.plan.apply.truncate(agg.run.len());
    }

    // Handlers, in aggregate key order.
    for agg in aggregates.values_mut() {
        if savepoints {
            apply_isolated(ctx, events, &mut tx, agg).await?;
        } else if !apply_optimistic(ctx, events, &mut tx, agg).await? {
            plumbing::db::bounded(tx.rollback()).await?;
            return Ok(None);
        }
    }
    if !savepoints
        && let Err(e) = plumbing::db::bounded(sqlx::raw_sql("SELECT 1").execute(&mut *tx)).await
    {
        // A handler swallowed a query error: find it with savepoints.
        if crate::dedup::is_infrastructure(&e) {
            return Err(e.into());
        }
        plumbing::db::bounded(tx.rollback()).await?;
        return Ok(None);
    }

    // Writes: positions, newly held, released.
    let mut updates = Vec::new();
    let mut hold_rows = Vec::new();
    let mut release_rows = Vec::new();
    for (key, agg) in aggregates.iter_mut() {
        let newly_held = match &agg.failure {
            Some((seq, ..)) => decide::cut_at_failure(&mut agg.plan, *seq, &agg.held),
            None => std::mem::take(&mut agg.plan.hold),
        };
        let applied = agg.plan.apply.last().copied();
        for seq in &agg.plan.apply {
            if agg.held.contains(seq) {
                release_rows.push((key.clone(), *seq));
            }
        }
        for seq in &newly_held {
            if let Some(&i) = agg.arrived.get(seq).and_then(|ix| ix.first())
                && let Some(env) = envelope(&items[i])
            {
                hold_rows.push(HeldRow {
                    key: key.clone(),
                    seq: *seq,
                    env,
                });
            }
        }
        match (&agg.failure, applied) {
            (Some((_, failure, reason, attempts)), _) => updates.push(PositionUpdate {
                key: key.clone(),
                applied: applied.unwrap_or(agg.position.applied),
                attempts: *attempts,
                retry_in: match failure {
                    HeadFailure::RetryAfterAttempt(n) => Some(cfg.retry_delay(*n)),
                    HeadFailure::Park => None,
                },
                park: matches!(failure, HeadFailure::Park),
                last_error: Some(reason.clone()),
            }),
            (None, Some(applied)) => updates.push(PositionUpdate {
                key: key.clone(),
                applied,
                attempts: 0,
                retry_in: None,
                park: false,
                last_error: None,
            }),
            (None, None) => {}
        }
        // Fates of the deliveries.
        let applied_set: BTreeSet<i64> = agg.plan.apply.iter().copied().collect();
        let held_now: BTreeSet<i64> = newly_held.iter().copied().collect();
        for (seq, ixs) in &agg.arrived {
            let fate = if applied_set.contains(seq) {
                Fate::Processed
            } else if held_now.contains(seq)
                || agg.plan.already_held.contains(seq)
                || (agg.failure.is_some() && agg.held.contains(seq))
            {
                Fate::Held
            } else {
                Fate::Stale
            };
            for (n, &i) in ixs.iter().enumerate() {
                fates[i] = Some(if n == 0 {
                    fate.clone()
                } else {
                    Fate::Duplicate
                });
            }
        }
        if !agg.plan.stale.is_empty() {
            tracing::debug!(
                aggregate_type = %key.aggregate_type,
                aggregate_id = %key.aggregate_id,
                applied = agg.position.applied,
                stale = ?agg.plan.stale,
                "stale messages (copies, or older than the applied position): not applied"
            );
        }
    }
    plumbing::db::bounded(store::write(
        &mut tx,
        schema,
        name,
        slot.partition,
        &updates,
        &hold_rows,
        &release_rows,
    ))
    .await?;
    plumbing::db::bounded(tx.commit()).await?;
    let released_count = aggregates
        .values()
        .flat_map(|a| a.run.iter().take(a.plan.apply.len()))
        .filter(|m| m.item.is_none())
        .count();
    if released_count > 0 {
        events.messages(
            crate::internal_events::Outcome::Processed,
            released_count as u64,
        );
    }
    for (key, agg) in &aggregates {
        if let Some((seq, failure, reason, _)) = &agg.failure {
            match failure {
                HeadFailure::Park => tracing::error!(
                    consumer = name,
                    aggregate_type = %key.aggregate_type,
                    aggregate_id = %key.aggregate_id,
                    aggregate_seq = seq,
                    %reason,
                    "aggregate parked: its head failed for good; it and everything after it are held until an operator retries, skips or dead-letters"
                ),
                HeadFailure::RetryAfterAttempt(n) => tracing::warn!(
                    consumer = name,
                    aggregate_type = %key.aggregate_type,
                    aggregate_id = %key.aggregate_id,
                    aggregate_seq = seq,
                    attempt = n,
                    %reason,
                    "handler failed; the aggregate waits for the retry (others go on)"
                ),
            }
        }
    }
    Ok(Some(fates))
}

/// Groups the batch by aggregate (decodable deliveries with a sequence number), plus the sweep's.
fn gather<'a>(items: &'a [Item], sweep: &[AggregateKey]) -> BTreeMap<AggregateKey, Aggregate<'a>> {
    let mut out: BTreeMap<AggregateKey, Aggregate<'a>> = BTreeMap::new();
    let empty = |key: AggregateKey| Aggregate {
        key,
        arrived: BTreeMap::new(),
        held: BTreeSet::new(),
        position: Position {
            applied: 0,
            head_waits: false,
        },
        attempts: 0,
        plan: Plan::default(),
        run: Vec::new(),
        failure: None,
    };
    for (i, item) in items.iter().enumerate() {
        let Some(env) = envelope_ref(item) else {
            continue;
        };
        let Some(seq) = env.aggregate_seq else {
            continue;
        };
        let key = AggregateKey::of(env);
        out.entry(key.clone())
            .or_insert_with(|| empty(key))
            .arrived
            .entry(seq)
            .or_default()
            .push(i);
    }
    for key in sweep {
        out.entry(key.clone()).or_insert_with(|| empty(key.clone()));
    }
    out
}

fn envelope_ref(item: &Item) -> Option<&Envelope> {
    match &item.work {
        Work::Handle(env, _) | Work::Advance(env) => Some(env),
        _ => None,
    }
}

fn envelope(item: &Item) -> Option<Envelope> {
    envelope_ref(item).cloned()
}

fn arrived_message(items: &[Item], i: usize) -> Message<'_> {
    match &items[i].work {
        Work::Handle(env, h) => Message {
            item: Some(i),
            env: MessageEnv::Arrived(env),
            handler: Some(h.clone()),
        },
        Work::Advance(env) => Message {
            item: Some(i),
            env: MessageEnv::Arrived(env),
            handler: None,
        },
        _ => unreachable!("gathered from Handle and Advance only"),
    }
}

/// Runs an aggregate's messages without savepoints, consecutive ones of one handler in one call.
/// False when a handler failed (the caller rolls back and re-runs with savepoints).
async fn apply_optimistic(
    ctx: &Ctx,
    events: &Events,
    tx: &mut sqlx::PgConnection,
    agg: &Aggregate<'_>,
) -> Result<bool, ApplyError> {
    let runs = agg.run.chunk_by(|a, b| match (&a.handler, &b.handler) {
        (Some(x), Some(y)) => Arc::ptr_eq(x, y),
        (None, None) => true,
        _ => false,
    });
    for run in runs {
        let Some(handler) = &run[0].handler else {
            continue; // no handler: the position advances, nothing else
        };
        let envs: Vec<&Envelope> = run.iter().map(|m| m.env.get()).collect();
        let span = tracing::info_span!(
            "ordered",
            aggregate_id = %agg.key.aggregate_id,
            from = envs[0].aggregate_seq,
            messages = envs.len()
        );
        match batch::run_handler(ctx, events, tx, &envs, handler)
            .instrument(span)
            .await
        {
            Ok(()) => {}
            Err(Failure::Infrastructure(e)) => return Err(e.into()),
            Err(Failure::Message { .. }) => return Ok(false),
        }
    }
    Ok(true)
}

/// Runs an aggregate's messages one at a time, each in a savepoint; the first failure ends the
/// aggregate's run (it and the rest are held) and records what the head's failure means.
async fn apply_isolated(
    ctx: &Ctx,
    events: &Events,
    tx: &mut sqlx::PgConnection,
    agg: &mut Aggregate<'_>,
) -> Result<(), ApplyError> {
    let mut applied = 0usize;
    for m in &agg.run {
        let Some(handler) = &m.handler else {
            applied += 1;
            continue;
        };
        let env = m.env.get();
        let span = batch::message_span(env, 1);
        plumbing::db::bounded(sqlx::raw_sql("SAVEPOINT consumer_message").execute(&mut *tx))
            .await?;
        let mut result = batch::run_handler(ctx, events, tx, &[env], handler)
            .instrument(span)
            .await;
        if result.is_ok()
            && let Err(e) = plumbing::db::bounded(
                sqlx::raw_sql("RELEASE SAVEPOINT consumer_message").execute(&mut *tx),
            )
            .await
        {
            result = Err(batch::classify_db(
                e,
                "the handler returned Ok but left its transaction unusable",
            ));
        }
        match result {
            Ok(()) => applied += 1,
            Err(Failure::Infrastructure(e)) => return Err(e.into()),
            Err(Failure::Message { permanent, reason }) => {
                plumbing::db::bounded(
                    sqlx::raw_sql("ROLLBACK TO SAVEPOINT consumer_message").execute(&mut *tx),
                )
                .await?;
                plumbing::db::bounded(
                    sqlx::raw_sql("RELEASE SAVEPOINT consumer_message").execute(&mut *tx),
                )
                .await?;
                let seq = env.aggregate_seq.unwrap_or_default();
                // Only the head (first of the run) has attempts behind it.
                let before = if applied == 0 { agg.attempts } else { 0 };
                let failure = decide::head_failure(before, ctx.config.max_attempts, permanent);
                agg.failure = Some((seq, failure, reason, before + 1));
                break;
            }
        }
    }
    agg.run.truncate(applied);
    Ok(())
}
