//! The ordered apply transaction: a batch of one partition's deliveries (or, for the sweep, just
//! the aggregates whose held messages may go now) applied in each aggregate's sequence order.
//!
//! 1. `BEGIN`; the fence (see [`super::group::fence`]): not the partition's owner any more, nothing
//!    is applied and the deliveries stay unacknowledged.
//! 2. Read the batch's aggregates' positions (created at 0 when new) with the numbers held for
//!    them; the fence's lock makes this transaction their only writer (see
//!    [`store::positions`]).
//! 3. Per aggregate, [`decide::plan`]: apply what is next in line (from this batch or from the
//!    held messages), hold what is ahead of a gap or behind a waiting head, report what is stale.
//! 4. Run the handlers, consecutive messages of an aggregate in one call where they share a
//!    handler; if one fails, the transaction is rolled back and begun again with a savepoint per
//!    message, so the failing message and the rest of its aggregate are held (retried after a
//!    backoff, or parked once attempts run out), and other aggregates go on.
//! 5. Write positions, held and released rows; `COMMIT`. The caller acknowledges after.

use super::decide::{self, HeadFailure, Plan, Position};
use super::group::{self, Slot};
use super::store::{self, AggregateKey, HeldRow, PositionUpdate};
use crate::batch::{self, Failure, Fate, Item, Work};
use crate::context::Ctx;
use crate::handler::DynHandler;
use crate::internal_events::{Events, Outcome};
use shared::Envelope;
use sqlx::{Postgres, Transaction};
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

/// A delivery of this batch with a sequence number.
struct Arrival<'a> {
    item: usize,
    env: &'a Envelope,
    /// `None`: no handler, the position advances without an effect.
    handler: Option<Arc<dyn DynHandler>>,
}

/// A message that runs now: arrived with this batch, or released from `consumer_held`.
struct Message<'a> {
    env: MessageEnv<'a>,
    handler: Option<Arc<dyn DynHandler>>,
}

enum MessageEnv<'a> {
    Arrived(&'a Envelope),
    Released(Box<Envelope>),
}

impl Message<'_> {
    fn env(&self) -> &Envelope {
        match &self.env {
            MessageEnv::Arrived(e) => e,
            MessageEnv::Released(e) => e,
        }
    }
}

/// A failure in this transaction: the message's number, what it means, the reason and the
/// message's failed attempts so far.
struct Failed {
    seq: i64,
    what: HeadFailure,
    reason: String,
    attempts: u32,
}

/// One aggregate's share of the batch.
struct Aggregate<'a> {
    /// Arrived, by sequence number; copies after the first.
    arrived: BTreeMap<i64, Vec<Arrival<'a>>>,
    held: BTreeSet<i64>,
    position: Position,
    attempts: u32,
    plan: Plan,
    run: Vec<Message<'a>>,
    failure: Option<Failed>,
}

/// The transaction after the locks and the plan, before the handlers.
struct Begun<'a> {
    tx: Transaction<'static, Postgres>,
    aggregates: BTreeMap<AggregateKey, Aggregate<'a>>,
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
    let Some(mut b) = begin(ctx, slot, items, sweep).await? else {
        return Ok(vec![None; items.len()]);
    };
    if !optimistic(ctx, events, &mut b).await? {
        plumbing::db::bounded(b.tx.rollback()).await?;
        let Some(again) = begin(ctx, slot, items, sweep).await? else {
            return Ok(vec![None; items.len()]);
        };
        b = again;
        isolated(ctx, events, &mut b).await?;
    }
    finish(ctx, events, slot, b, items.len()).await
}

/// `BEGIN`, the fence, the locked positions with their held numbers, each aggregate's plan and
/// the held messages it releases. `None` when the batch has no numbered message and no sweep.
async fn begin<'a>(
    ctx: &Ctx,
    slot: Slot,
    items: &'a [Item],
    sweep: &[AggregateKey],
) -> Result<Option<Begun<'a>>, ApplyError> {
    let cfg = &ctx.config;
    let (schema, name) = (&cfg.schema, cfg.name.as_str());
    let mut aggregates = gather(items, sweep);
    if aggregates.is_empty() {
        return Ok(None);
    }
    let mut tx = plumbing::db::bounded(ctx.pool.begin()).await?;
    if !plumbing::db::bounded(group::fence(&mut tx, schema, name, &cfg.instance_id, slot)).await? {
        let _ = plumbing::db::bounded(tx.rollback()).await;
        return Err(ApplyError::Fenced(slot.partition));
    }
    let keys: Vec<AggregateKey> = aggregates.keys().cloned().collect();
    let mut heads = plumbing::db::bounded(store::positions(
        &mut tx,
        schema,
        name,
        slot.partition,
        &keys,
    ))
    .await?;
    for (key, agg) in aggregates.iter_mut() {
        let head = heads.remove(key).unwrap_or_default();
        agg.position = Position {
            applied: head.applied,
            head_waits: head.waits,
        };
        agg.attempts = head.attempts;
        agg.held = head.held;
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
        for seq in agg.plan.apply.clone() {
            let message = match agg.arrived.get(&seq).and_then(|copies| copies.first()) {
                Some(a) => Message {
                    env: MessageEnv::Arrived(a.env),
                    handler: a.handler.clone(),
                },
                None => match released.remove(&(key.clone(), seq)) {
                    Some(env) => Message {
                        handler: ctx.handlers.resolve(&env.event_type).cloned(),
                        env: MessageEnv::Released(Box::new(env)),
                    },
                    None => {
                        // Listed but not readable: it and what follows wait (held) for the sweep.
                        let newly = decide::cut_at_failure(&mut agg.plan, seq, &agg.held);
                        agg.plan.hold = newly;
                        break;
                    }
                },
            };
            agg.run.push(message);
        }
    }
    Ok(Some(Begun { tx, aggregates }))
}

/// Runs every aggregate's messages without savepoints: all aggregates' runs, each in its order,
/// one after the other (aggregates are independent), so consecutive messages of one handler go
/// in one call: one call per batch when one handler takes everything. False when a handler
/// failed (or left the transaction unusable): roll back and go isolated.
async fn optimistic(ctx: &Ctx, events: &Events, b: &mut Begun<'_>) -> Result<bool, ApplyError> {
    let all: Vec<&Message<'_>> = b.aggregates.values().flat_map(|a| &a.run).collect();
    let runs = all.chunk_by(|a, b| match (&a.handler, &b.handler) {
        (Some(x), Some(y)) => Arc::ptr_eq(x, y),
        (None, None) => true,
        _ => false,
    });
    for run in runs {
        let Some(handler) = &run[0].handler else {
            continue; // no handler: the position advances, nothing else
        };
        let envs: Vec<&Envelope> = run.iter().map(|m| m.env()).collect();
        let span = tracing::info_span!("ordered", messages = envs.len());
        match batch::run_handler(ctx, events, &mut b.tx, &envs, handler)
            .instrument(span)
            .await
        {
            Ok(()) => {}
            Err(Failure::Infrastructure(e)) => return Err(e.into()),
            Err(Failure::Message { .. } | Failure::Unavailable { .. }) => return Ok(false),
        }
    }
    // A handler that swallowed a query error leaves the transaction aborted.
    match plumbing::db::bounded(sqlx::raw_sql("SELECT 1").execute(&mut *b.tx)).await {
        Ok(_) => Ok(true),
        Err(e) if crate::dedup::is_infrastructure(&e) => Err(e.into()),
        Err(_) => Ok(false),
    }
}

/// Runs each aggregate's messages one at a time, each in a savepoint; an aggregate's first
/// failure ends its run (it and the rest are held) and records what the failure means.
async fn isolated(ctx: &Ctx, events: &Events, b: &mut Begun<'_>) -> Result<(), ApplyError> {
    for agg in b.aggregates.values_mut() {
        let mut applied = 0usize;
        for m in &agg.run {
            let Some(handler) = &m.handler else {
                applied += 1;
                continue;
            };
            let env = m.env();
            let result = savepoint(ctx, events, &mut b.tx, env, handler).await?;
            let Err(failed) = result else {
                applied += 1;
                continue;
            };
            // Only the head (first of the run) has failed attempts behind it.
            let before = if applied == 0 { agg.attempts } else { 0 };
            let seq = env.aggregate_seq.unwrap_or_default();
            agg.failure = Some(match failed {
                // Waiting for a remote spends no attempt and never parks.
                HeadError::Unavailable { reason, wait } => Failed {
                    seq,
                    what: HeadFailure::Wait(wait),
                    reason,
                    attempts: before,
                },
                HeadError::Failed { permanent, reason } => Failed {
                    seq,
                    what: decide::head_failure(before, ctx.config.max_attempts, permanent),
                    reason,
                    attempts: before + 1,
                },
            });
            break;
        }
        agg.run.truncate(applied);
    }
    Ok(())
}

/// Why a message failed in its savepoint.
enum HeadError {
    Failed {
        permanent: bool,
        reason: String,
    },
    Unavailable {
        reason: String,
        wait: std::time::Duration,
    },
}

/// One message in a savepoint: `Ok(Err(..))` when it failed (rolled back alone).
async fn savepoint(
    ctx: &Ctx,
    events: &Events,
    tx: &mut sqlx::PgConnection,
    env: &Envelope,
    handler: &Arc<dyn DynHandler>,
) -> Result<Result<(), HeadError>, ApplyError> {
    exec(tx, "SAVEPOINT consumer_message").await?;
    let mut result = batch::run_handler(ctx, events, tx, &[env], handler)
        .instrument(batch::message_span(env, 1))
        .await;
    if result.is_ok()
        && let Err(e) = exec(tx, "RELEASE SAVEPOINT consumer_message").await
    {
        result = Err(batch::classify_db(
            e,
            "the handler returned Ok but left its transaction unusable",
        ));
    }
    match result {
        Ok(()) => Ok(Ok(())),
        Err(Failure::Infrastructure(e)) => Err(e.into()),
        Err(Failure::Message { permanent, reason }) => {
            exec(tx, "ROLLBACK TO SAVEPOINT consumer_message").await?;
            exec(tx, "RELEASE SAVEPOINT consumer_message").await?;
            Ok(Err(HeadError::Failed { permanent, reason }))
        }
        Err(Failure::Unavailable { reason, wait }) => {
            exec(tx, "ROLLBACK TO SAVEPOINT consumer_message").await?;
            exec(tx, "RELEASE SAVEPOINT consumer_message").await?;
            Ok(Err(HeadError::Unavailable { reason, wait }))
        }
    }
}

async fn exec(tx: &mut sqlx::PgConnection, sql: &'static str) -> Result<(), sqlx::Error> {
    plumbing::db::bounded(sqlx::raw_sql(sql).execute(tx))
        .await
        .map(|_| ())
}

/// Writes positions, newly held and released rows, commits, and decides each delivery's fate:
/// applied, or held (newly, or already), or stale. Nothing else: an arrived message is never
/// acknowledged without one of these committed.
async fn finish(
    ctx: &Ctx,
    events: &Events,
    slot: Slot,
    b: Begun<'_>,
    items: usize,
) -> Result<Vec<Option<Fate>>, ApplyError> {
    let cfg = &ctx.config;
    let Begun {
        mut tx,
        mut aggregates,
    } = b;
    let mut fates: Vec<Option<Fate>> = vec![None; items];
    let (mut updates, mut hold, mut release) = (Vec::new(), Vec::new(), Vec::new());
    let mut released = 0u64;
    for (key, agg) in aggregates.iter_mut() {
        let newly_held = match &agg.failure {
            Some(f) => decide::cut_at_failure(&mut agg.plan, f.seq, &agg.held),
            None => std::mem::take(&mut agg.plan.hold),
        };
        for seq in agg.plan.apply.iter().filter(|s| agg.held.contains(s)) {
            release.push((key.clone(), *seq));
        }
        released += agg
            .run
            .iter()
            .filter(|m| matches!(m.env, MessageEnv::Released(_)))
            .count() as u64;
        for seq in &newly_held {
            if let Some(a) = agg.arrived.get(seq).and_then(|copies| copies.first()) {
                hold.push(HeldRow {
                    key: key.clone(),
                    seq: *seq,
                    env: a.env.clone(),
                });
            }
        }
        if let Some(u) = position_update(cfg, key, agg) {
            updates.push(u);
        }
        let applied: BTreeSet<i64> = agg.plan.apply.iter().copied().collect();
        for (seq, copies) in &agg.arrived {
            let fate = if applied.contains(seq) {
                Fate::Processed
            } else if agg.plan.stale.contains(seq) {
                Fate::Stale
            } else {
                Fate::Held // newly held above, or held already
            };
            for (n, a) in copies.iter().enumerate() {
                fates[a.item] = Some(if n == 0 {
                    fate.clone()
                } else {
                    Fate::Duplicate
                });
            }
        }
        if !agg.plan.stale.is_empty() {
            tracing::debug!(aggregate_type = %key.aggregate_type, aggregate_id = %key.aggregate_id, applied = agg.position.applied, stale = ?agg.plan.stale, "stale messages (copies, or older than the applied position): not applied");
        }
    }
    let (schema, name) = (&cfg.schema, cfg.name.as_str());
    plumbing::db::bounded(store::write(
        &mut tx,
        schema,
        name,
        slot.partition,
        &updates,
        &hold,
        &release,
    ))
    .await?;
    plumbing::db::bounded(tx.commit()).await?;
    if released > 0 {
        events.messages(Outcome::Processed, released);
    }
    for (key, agg) in &aggregates {
        if let Some(f) = &agg.failure {
            log_failure(name, key, f);
        }
    }
    Ok(fates)
}

/// The aggregate's new position: after what was applied, and the head's failure if one failed.
fn position_update(
    cfg: &crate::Config,
    key: &AggregateKey,
    agg: &Aggregate<'_>,
) -> Option<PositionUpdate> {
    let applied = agg.plan.apply.last().copied();
    match (&agg.failure, applied) {
        (Some(f), _) => Some(PositionUpdate {
            key: key.clone(),
            applied: applied.unwrap_or(agg.position.applied),
            attempts: f.attempts,
            retry_in: match f.what {
                HeadFailure::RetryAfterAttempt(n) => Some(cfg.retry_delay(n)),
                HeadFailure::Wait(d) => Some(d.max(std::time::Duration::from_millis(100))),
                HeadFailure::Park => None,
            },
            park: f.what == HeadFailure::Park,
            last_error: Some(f.reason.clone()),
        }),
        (None, Some(applied)) => Some(PositionUpdate {
            key: key.clone(),
            applied,
            attempts: 0,
            retry_in: None,
            park: false,
            last_error: None,
        }),
        (None, None) => None,
    }
}

fn log_failure(consumer: &str, key: &AggregateKey, f: &Failed) {
    let (t, id, seq, reason) = (&key.aggregate_type, &key.aggregate_id, f.seq, &f.reason);
    match f.what {
        HeadFailure::Park => tracing::error!(
            consumer, aggregate_type = %t, aggregate_id = %id, aggregate_seq = seq, %reason,
            "aggregate parked: its head failed for good; it and everything after it are held until an operator retries, skips or dead-letters"
        ),
        HeadFailure::RetryAfterAttempt(n) => tracing::warn!(
            consumer, aggregate_type = %t, aggregate_id = %id, aggregate_seq = seq, attempt = n, %reason,
            "handler failed; the aggregate waits for the retry (others go on)"
        ),
        HeadFailure::Wait(wait) => tracing::info!(
            consumer, aggregate_type = %t, aggregate_id = %id, aggregate_seq = seq, ?wait, %reason,
            "remote unavailable; the aggregate waits for it (no attempt spent, others go on)"
        ),
    }
}

/// Groups the batch by aggregate (deliveries with a sequence number: handled or advancing),
/// plus the sweep's aggregates.
fn gather<'a>(items: &'a [Item], sweep: &[AggregateKey]) -> BTreeMap<AggregateKey, Aggregate<'a>> {
    let empty = || Aggregate {
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
    let mut out: BTreeMap<AggregateKey, Aggregate<'a>> = BTreeMap::new();
    for (item, it) in items.iter().enumerate() {
        let (env, handler) = match &it.work {
            Work::Handle(env, h) => (env.as_ref(), Some(h.clone())),
            Work::Advance(env) => (env.as_ref(), None),
            // Never deferred in ordered mode (a fair share is refused there).
            Work::Reject(..) | Work::Ignore | Work::Lane(_) => continue,
        };
        let Some(seq) = env.aggregate_seq else {
            continue;
        };
        out.entry(AggregateKey::of(env))
            .or_insert_with(empty)
            .arrived
            .entry(seq)
            .or_default()
            .push(Arrival { item, env, handler });
    }
    for key in sweep {
        out.entry(key.clone()).or_insert_with(empty);
    }
    out
}
