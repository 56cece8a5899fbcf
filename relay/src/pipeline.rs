//! The publishing pipeline: claiming, publishing and marking overlap, so the broker always has a
//! window of publishes to confirm.
//!
//! Every claimed row stays in `claimed` until it is settled (marked published, or given back to
//! the outbox after a failure); claims exclude those rows, so a row is never sent twice by one
//! relay. A claim may run while a mark commits: rows whose mark finished during a claim are
//! remembered until that claim returns, so a snapshot taken before the delete cannot resurrect them.
//!
//! Order: rows are grouped into per-aggregate chains. A chain has at most one row in flight; its
//! next row is sent only after the broker confirmed the previous one. A refused row (nack, return)
//! gives every unsent row of its partition back to the outbox and blocks the partition for the
//! retry backoff (locally and in `relay_partitions`, so any relay respects it). A link failure gives
//! back everything unconfirmed. A channel closed by a refusal sends the rows that were in flight
//! again one at a time, so the one to blame is found and charged. Either way nothing later of an aggregate overtakes an earlier row.

use crate::RelayOptions;
use crate::encoder::{self, Encoded, Limits};
use crate::internal_events::{self, DbOp, FailureReason};
use crate::leases::Leases;
use crate::publisher::Publisher;
use crate::store::{self, Charge, Claimed, OutboxRow};
use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use lapin::Confirmation;
use plumbing::telemetry::{ErrorChain, Readiness};
use sqlx::PgPool;
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// A running mark (delete or update of confirmed rows).
type MarkTask = JoinHandle<Result<(), sqlx::Error>>;
/// A running claim.
type ClaimTask = JoinHandle<Result<Vec<Claimed>, sqlx::Error>>;
type ConfirmResult = Result<Result<Confirmation, lapin::Error>, tokio::time::error::Elapsed>;
/// How long a stopping relay keeps trying to mark confirmed rows, beyond the confirm timeout.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// Nacks in a row (no ack between) after which the relay reconnects.
const NACKS_BEFORE_RECONNECT: u32 = 5;
/// Longest the relay publishes one row at a time to find the row the broker refused.
const ISOLATION_LIMIT: Duration = Duration::from_secs(60);
type ConfirmFuture = Pin<Box<dyn Future<Output = (OutboxRow, ConfirmResult, Instant)> + Send>>;

/// The rows of one aggregate that this relay holds, in seq order.
struct Chain {
    partition: i16,
    /// A row of this aggregate was sent and is not confirmed yet.
    in_flight: bool,
    queue: VecDeque<OutboxRow>,
}

enum Event {
    Confirm(Box<(OutboxRow, ConfirmResult)>, Instant),
    Claimed(Result<Vec<Claimed>, String>),
    Marked(Result<(), String>),
    Wake,
    Stop,
}

/// The broker closed the channel over a message, and several were in flight: until each of them
/// is settled, rows are sent one at a time, so a refusal names its row.
struct Isolation {
    suspects: HashSet<i64>,
    until: Instant,
}

pub(crate) struct Pipeline<'a> {
    pool: &'a PgPool,
    publisher: Publisher,
    leases: &'a Leases,
    wake: &'a Notify,
    readiness: &'a Readiness,
    opts: &'a RelayOptions,
    /// Every claimed, unsettled row: seq -> partition.
    claimed: HashMap<i64, i16>,
    chains: HashMap<String, Chain>,
    /// Aggregates whose chain may send its next row.
    ready: VecDeque<String>,
    confirms: FuturesUnordered<ConfirmFuture>,
    /// Rows sent and not settled yet (the ones `confirms` waits for).
    in_flight: HashSet<i64>,
    /// Set after the broker refused a message while several were in flight.
    isolation: Option<Isolation>,
    /// Confirmed rows waiting for their mark.
    to_mark: Vec<i64>,
    /// Confirmed rows that had failed before: their partition may be unblocked once marked.
    retried: Vec<i64>,
    marking: Option<(MarkTask, Vec<i64>)>,
    /// The running claim, with the [`generation`](Self::generation) it started in.
    claiming: Option<(ClaimTask, u64)>,
    /// Bumped whenever rows are given back to the outbox. A claim that started before cannot
    /// know those rows are free again, so its rows (later ones of the same aggregates) would
    /// overtake them: its result is dropped and the claim redone.
    generation: u64,
    /// Partitions with a refused row: nothing of theirs is sent before this time.
    blocked: HashMap<i16, Instant>,
    /// Partitions being given back for rebalancing: not claimed, released once nothing of theirs
    /// is claimed.
    releasing: HashSet<i16>,
    /// Message ids the broker returned (unroutable), with the reason, until their row is settled.
    returned: HashMap<String, String>,
    /// Claim again without waiting for a wake-up (the last claim found rows).
    more: bool,
    /// Rows whose mark finished while a claim was running: that claim's snapshot may still show
    /// them as pending, so its result must not hand them out again.
    marked_during_claim: HashSet<i64>,
    db_failures: u32,
    amqp_failures: u32,
    retry_at: Option<Instant>,
    /// RabbitMQ blocks the connection (resource alarm): nothing is sent or claimed until it
    /// unblocks; what is in flight waits for its confirm without timing out.
    broker_blocked: bool,
    /// Nacks since the last ack: a channel whose quorum-queue client lost track of the leader
    /// (a node of the cluster died) nacks every publish until it is reopened.
    nacks_in_a_row: u32,
}

impl<'a> Pipeline<'a> {
    pub(crate) fn new(
        pool: &'a PgPool,
        publisher: Publisher,
        leases: &'a Leases,
        wake: &'a Notify,
        readiness: &'a Readiness,
        opts: &'a RelayOptions,
    ) -> Self {
        Self {
            pool,
            publisher,
            leases,
            wake,
            readiness,
            opts,
            claimed: HashMap::new(),
            chains: HashMap::new(),
            ready: VecDeque::new(),
            confirms: FuturesUnordered::new(),
            in_flight: HashSet::new(),
            isolation: None,
            to_mark: Vec::new(),
            retried: Vec::new(),
            marking: None,
            claiming: None,
            blocked: HashMap::new(),
            releasing: HashSet::new(),
            returned: HashMap::new(),
            generation: 0,
            more: true,
            marked_during_claim: HashSet::new(),
            db_failures: 0,
            amqp_failures: 0,
            retry_at: None,
            broker_blocked: false,
            nacks_in_a_row: 0,
        }
    }

    /// Runs until `shutdown`, then settles what is in flight and marks what was confirmed, for at
    /// most the confirm timeout plus [`STOP_GRACE`]: whatever is not marked by then (the database
    /// is failing or silent) stays pending and is published again later. Returns the publisher
    /// for a clean disconnect.
    pub(crate) async fn run(mut self, shutdown: &CancellationToken) -> Publisher {
        let mut poll = tokio::time::interval(self.opts.poll_interval());
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop_by: Option<Instant> = None;
        loop {
            let stopping = shutdown.is_cancelled();
            if stopping {
                self.give_back_unsent();
                let deadline = *stop_by.get_or_insert_with(|| {
                    Instant::now() + self.opts.confirm_timeout() + STOP_GRACE
                });
                if Instant::now() >= deadline {
                    self.abandon_at_stop();
                    break;
                }
            }
            let backoff_over = self.retry_at.is_none_or(|t| Instant::now() >= t);
            if backoff_over {
                self.retry_at = None;
            }
            if !stopping
                && backoff_over
                && self.confirms.is_empty()
                && !self.publisher.is_connected()
            {
                self.connect().await;
            }
            self.watch_blocked();
            if !stopping {
                self.rebalance().await;
                self.fill_window().await;
            }
            self.start_db_op(stopping);
            if stopping
                && self.confirms.is_empty()
                && self.marking.is_none()
                && self.claiming.is_none()
                && self.to_mark.is_empty()
            {
                break;
            }

            let retry_at = self.retry_at;
            let (confirms, claiming, marking) =
                (&mut self.confirms, &mut self.claiming, &mut self.marking);
            let event = tokio::select! {
                Some((row, result, sent)) = confirms.next(), if !confirms.is_empty() => Event::Confirm(Box::new((row, result)), sent),
                r = async { (&mut claiming.as_mut().expect("guarded").0).await }, if claiming.is_some() => Event::Claimed(flatten(r)),
                r = async { (&mut marking.as_mut().expect("guarded").0).await }, if marking.is_some() => Event::Marked(flatten(r)),
                _ = self.wake.notified(), if !stopping => Event::Wake,
                _ = poll.tick(), if !stopping => Event::Wake,
                _ = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if retry_at.is_some() => Event::Wake,
                _ = shutdown.cancelled(), if !stopping => Event::Stop,
                _ = tokio::time::sleep_until(stop_by.unwrap_or_else(Instant::now)), if stop_by.is_some() => Event::Stop,
            };
            match event {
                Event::Confirm(confirmed, sent) => {
                    internal_events::confirm_duration(sent.elapsed());
                    // Confirms of one multiple-ack resolve together, and lapin hands a basic.return
                    // to whichever of them it completes first: take every ready confirm, learn
                    // which messages were really returned (by message id), then settle each row.
                    let mut batch = vec![*confirmed];
                    while let Some(Some((row, result, sent))) = self.confirms.next().now_or_never()
                    {
                        internal_events::confirm_duration(sent.elapsed());
                        batch.push((row, result));
                    }
                    for (_, result) in &mut batch {
                        if let Ok(Ok(Confirmation::Ack(returned) | Confirmation::Nack(returned))) =
                            result
                            && let Some(r) = returned.take()
                        {
                            let id = r
                                .delivery
                                .properties
                                .message_id()
                                .as_ref()
                                .map(|m| m.as_str().to_string());
                            if let Some(id) = id {
                                self.returned.insert(
                                    id,
                                    format!(
                                        "unroutable: {} {}",
                                        r.reply_code,
                                        r.reply_text.as_str()
                                    ),
                                );
                            }
                        }
                    }
                    // Acks first: a failure in the batch drops the link and gives back everything
                    // unconfirmed, and rows the broker did confirm need not be published again.
                    // Once the link is dropped (which empties `in_flight`), the rest of the batch
                    // are answers of that link (its closing error, seen by every publish in
                    // flight), not of their rows: those rows went back to the outbox with it.
                    batch.sort_by_key(|(_, r)| !matches!(r, Ok(Ok(Confirmation::Ack(_)))));
                    for (row, result) in batch {
                        if self.in_flight.contains(&row.seq) {
                            self.on_confirm(row, result).await;
                        }
                    }
                    if self.confirms.is_empty() {
                        // Every return belongs to a publish that was in flight.
                        self.returned.clear();
                    }
                }
                Event::Claimed(result) => {
                    let started_in = self.claiming.take().map_or(self.generation, |(_, g)| g);
                    self.on_claimed(result, started_in).await
                }
                Event::Marked(result) => self.on_marked(result).await,
                Event::Wake => self.more = true,
                Event::Stop => {}
            }
        }
        self.publisher
    }

    /// The shutdown deadline passed: stop waiting for confirms and the database. Nothing is lost:
    /// every row not marked is still pending in the outbox.
    fn abandon_at_stop(&mut self) {
        let marking = self.marking.take().map_or(0, |(task, seqs)| {
            task.abort();
            seqs.len()
        });
        if let Some((task, _)) = self.claiming.take() {
            task.abort();
        }
        tracing::warn!(
            unconfirmed = self.confirms.len(),
            unmarked = self.to_mark.len() + marking,
            "stopping before everything was settled: these rows stay pending and will be published again"
        );
    }

    /// Follows `connection.blocked` / `connection.unblocked` (checked every turn; the poll tick
    /// guarantees a turn at least every poll interval): blocked means not ready.
    fn watch_blocked(&mut self) {
        let blocked = self.publisher.is_blocked();
        if blocked == self.broker_blocked {
            return;
        }
        self.broker_blocked = blocked;
        internal_events::broker_blocked(blocked);
        if blocked {
            tracing::warn!(
                in_flight = self.confirms.len(),
                "RabbitMQ blocked publishing (resource alarm); waiting for it to unblock"
            );
        } else {
            tracing::info!("RabbitMQ unblocked publishing");
            self.more = true;
        }
        self.set_ready(None, Some(!blocked && self.publisher.is_connected()));
    }

    async fn connect(&mut self) {
        match self.publisher.ensure_connected().await {
            Ok(()) => {
                self.amqp_failures = 0;
                // Whether the (possibly same) connection is blocked is watch_blocked's to say.
                self.set_ready(None, Some(!self.broker_blocked));
                self.more = true;
            }
            Err(e) => {
                self.amqp_failures += 1;
                self.set_ready(None, Some(false));
                internal_events::reconnect("rabbitmq");
                tracing::warn!(error = %ErrorChain(&e), attempt = self.amqp_failures, "RabbitMQ unavailable; retrying");
                self.back_off(self.amqp_failures);
            }
        }
    }

    fn back_off(&mut self, failures: u32) {
        let d =
            plumbing::backoff::delay(failures, Duration::from_millis(100), Duration::from_secs(5));
        self.retry_at = Some(Instant::now() + d);
    }

    fn set_ready(&self, postgres: Option<bool>, rabbitmq: Option<bool>) {
        crate::set_ready(self.readiness, postgres, rabbitmq);
    }

    /// Starts a mark and a claim when due (at most one of each at a time).
    fn start_db_op(&mut self, stopping: bool) {
        if self.marking.is_none() && !self.to_mark.is_empty() && self.retry_at.is_none() {
            let seqs = std::mem::take(&mut self.to_mark);
            let pool = self.pool.clone();
            let schema = self.leases.schema().clone();
            let retain = self.opts.retention_secs > 0;
            let batch = seqs.clone();
            self.marking = Some((
                tokio::spawn(async move {
                    let started = Instant::now();
                    let done = plumbing::db::bounded(store::mark_published(
                        &pool, &schema, &batch, retain,
                    ))
                    .await;
                    internal_events::db_duration(DbOp::Mark, started.elapsed());
                    done
                }),
                seqs,
            ));
        }
        let claim_due = !stopping
            && self.more
            && self.claiming.is_none()
            && self.retry_at.is_none()
            && self.publisher.is_connected()
            && !self.broker_blocked
            && self.claimed.len() < 2 * self.opts.batch_size as usize;
        if claim_due {
            self.start_claim();
        }
    }

    fn start_claim(&mut self) {
        let need = self.opts.confirm_timeout() + self.opts.lease() / 10;
        let now = Instant::now();
        let (mut partitions, _) = self.leases.usable(need);
        self.blocked.retain(|_, until| *until > now);
        partitions.retain(|p| !self.blocked.contains_key(p) && !self.releasing.contains(p));
        if partitions.is_empty() {
            self.more = false;
            return;
        }
        let batch = self.opts.batch_size as i64;
        let per_partition = ((batch * 2) / partitions.len() as i64).clamp(8, batch);
        let held: Vec<(i64, i16)> = self.claimed.iter().map(|(s, p)| (*s, *p)).collect();
        let pool = self.pool.clone();
        let schema = self.leases.schema().clone();
        let owner = self.leases.instance_id.clone();
        self.more = false;
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let rows = plumbing::db::bounded(store::claim(
                &pool,
                &schema,
                &owner,
                &partitions,
                per_partition,
                batch,
                &held,
            ))
            .await;
            internal_events::db_duration(DbOp::Claim, started.elapsed());
            rows
        });
        self.claiming = Some((task, self.generation));
    }

    async fn on_claimed(&mut self, result: Result<Vec<Claimed>, String>, started_in: u64) {
        let marked = std::mem::take(&mut self.marked_during_claim);
        let claimed = match result {
            Ok(rows) => rows,
            Err(e) => {
                self.db_failures += 1;
                self.set_ready(Some(false), None);
                internal_events::reconnect("postgres");
                tracing::warn!(error = %e, attempt = self.db_failures, "claim failed; retrying");
                self.back_off(self.db_failures);
                self.more = true;
                return;
            }
        };
        self.db_failures = 0;
        self.set_ready(Some(true), None);
        if started_in != self.generation {
            // Rows were given back while this claim ran: claim again from the partition heads.
            self.more = true;
            return;
        }
        if claimed.is_empty() {
            return;
        }
        self.more = true;
        internal_events::batch_claimed(claimed.len());
        let wall = chrono::Utc::now();
        let now = Instant::now();
        for item in claimed {
            let row = match item {
                Claimed::Row(row) => row,
                Claimed::Undecodable {
                    seq,
                    partition,
                    reason,
                } => {
                    if !self.claimed.contains_key(&seq) && !marked.contains(&seq) {
                        self.bury(seq, partition, None, &reason).await;
                    }
                    continue;
                }
            };
            internal_events::claim_lag((wall - row.created_at).to_std().unwrap_or_default());
            let p = row.partition;
            if self.claimed.contains_key(&row.seq)
                || marked.contains(&row.seq)
                || self.blocked.get(&p).is_some_and(|until| *until > now)
                || self.releasing.contains(&p)
            {
                continue;
            }
            self.claimed.insert(row.seq, p);
            let chain = self
                .chains
                .entry(row.aggregate_id.clone())
                .or_insert_with(|| Chain {
                    partition: p,
                    in_flight: false,
                    queue: VecDeque::new(),
                });
            chain.queue.push_back(row);
            if !chain.in_flight && chain.queue.len() == 1 {
                self.ready.push_back(chain.queue[0].aggregate_id.clone());
            }
        }
    }

    /// Marks a row dead at once because it can never be published as it is (it broke a rule, does
    /// not fit, or cannot be decoded). It holds nothing back from then on. If the mark fails, the
    /// row stays pending and its partition waits a retry delay before it is tried again.
    async fn bury(&mut self, seq: i64, partition: i16, id: Option<uuid::Uuid>, reason: &str) {
        internal_events::publish_failed(FailureReason::Unpublishable, 1);
        self.claimed.remove(&seq);
        let recorded = plumbing::db::bounded(store::record_failure(
            self.pool,
            self.leases.schema(),
            seq,
            partition,
            reason,
            Charge::Unpublishable,
        ))
        .await;
        let message_id = id.map(|i| i.to_string()).unwrap_or_default();
        match recorded {
            Ok(_) => {
                internal_events::rows_dead(1);
                if self.claiming.is_some() {
                    self.marked_during_claim.insert(seq);
                }
                tracing::error!(%message_id, seq, partition, %reason, "row can never be published as it is: marked dead");
            }
            Err(e) => {
                self.give_back_partition(partition);
                self.blocked
                    .insert(partition, Instant::now() + self.opts.retry_delay(1));
                tracing::warn!(error = %ErrorChain(&e), %message_id, seq, %reason, "marking an unpublishable row dead failed; its partition waits");
            }
        }
    }

    /// Sends ready rows while the window has room.
    ///
    /// All of them are handed to lapin at once: each publish waits until lapin's I/O thread has
    /// written its frames, so sending one at a time costs two thread hand-offs per message, while
    /// a whole batch is written and acknowledged in one. (lapin numbers a publish for its confirm
    /// and queues its frames in the same poll, so confirms still match their rows.)
    async fn fill_window(&mut self) {
        let now = Instant::now();
        if self
            .isolation
            .as_ref()
            .is_some_and(|i| i.suspects.is_empty() || i.until <= now)
        {
            self.isolation = None;
        }
        let window = if self.isolation.is_some() {
            1
        } else {
            self.opts.window as usize
        };
        if self.broker_blocked {
            return;
        }
        let Some(frame_max) = self.publisher.frame_max() else {
            return;
        };
        let limits = Limits {
            frame_max,
            max_payload_bytes: usize::try_from(self.opts.max_payload_bytes).unwrap_or(usize::MAX),
        };
        let timeout = self.opts.confirm_timeout();
        let mut batch: Vec<(OutboxRow, Encoded, tracing::Span)> = Vec::new();
        let mut unpublishable: Vec<(OutboxRow, String)> = Vec::new();
        while self.confirms.len() + batch.len() < window && self.publisher.is_connected() {
            let Some(aggregate) = self.ready.pop_front() else {
                break;
            };
            let Some(chain) = self.chains.get_mut(&aggregate) else {
                continue;
            };
            if chain.in_flight {
                continue;
            }
            let p = chain.partition;
            // The lease must outlast the confirm, or another relay could publish the partition too.
            let lease_ok = self
                .leases
                .valid_until(p)
                .is_some_and(|until| until > Instant::now() + timeout);
            if !lease_ok {
                self.give_back_partition(p);
                continue;
            }
            let Some(row) = chain.queue.pop_front() else {
                self.chains.remove(&aggregate);
                continue;
            };
            match encoder::encode(&row, &limits) {
                Ok(encoded) => {
                    chain.in_flight = true;
                    let span = publish_span(&row);
                    batch.push((row, encoded, span));
                }
                Err(e) => {
                    // Dead, so it holds nothing back: the aggregate's next row may go.
                    if chain.queue.is_empty() {
                        self.chains.remove(&aggregate);
                    } else {
                        self.ready.push_back(aggregate);
                    }
                    unpublishable.push((row, format!("unpublishable: {e}")));
                }
            }
        }
        for (row, reason) in unpublishable {
            self.bury(row.seq, row.partition, Some(row.id), &reason)
                .await;
        }
        if batch.is_empty() {
            return;
        }
        let sent = Instant::now();
        let results = futures::future::join_all(batch.iter().map(|(row, encoded, span)| {
            self.publisher
                .send(encoded, row.payload.as_bytes())
                .instrument(span.clone())
        }))
        .await;
        let mut failure = None;
        let status = self.publisher.status();
        for ((row, _, _), result) in batch.into_iter().zip(results) {
            match result {
                Ok(confirm) => {
                    self.in_flight.insert(row.seq);
                    let status = status.clone();
                    self.confirms.push(Box::pin(async move {
                        tokio::pin!(confirm);
                        // A blocked connection is not a dead one: its confirms come after the
                        // unblock (a lost link still ends the wait with an error).
                        let result = loop {
                            match tokio::time::timeout(timeout, confirm.as_mut()).await {
                                Err(_) if status.as_ref().is_some_and(|s| s.blocked()) => continue,
                                r => break r,
                            }
                        };
                        (row, result, sent)
                    }))
                }
                Err(e) => {
                    self.claimed.remove(&row.seq);
                    failure.get_or_insert(e.to_string());
                }
            }
        }
        if let Some(e) = failure {
            // Everything unconfirmed, including what was just sent, goes back to the outbox.
            self.link_failed(FailureReason::Connection, &e).await;
        }
    }

    async fn on_confirm(&mut self, row: OutboxRow, result: ConfirmResult) {
        self.in_flight.remove(&row.seq);
        if let Some(isolation) = &mut self.isolation {
            isolation.suspects.remove(&row.seq);
        }
        match result {
            Ok(Ok(Confirmation::Ack(_)))
                if !self.returned.is_empty() && self.returned.contains_key(&row.id.to_string()) =>
            {
                let why = self
                    .returned
                    .remove(&row.id.to_string())
                    .unwrap_or_default();
                self.refused(row, FailureReason::Unroutable, why).await;
            }
            Ok(Ok(Confirmation::Ack(_))) => {
                self.nacks_in_a_row = 0;
                let latency = (chrono::Utc::now() - row.created_at)
                    .to_std()
                    .unwrap_or_default();
                internal_events::publish_latency(latency);
                self.to_mark.push(row.seq);
                if row.attempts > 0 {
                    self.retried.push(row.seq);
                }
                if let Some(chain) = self.chains.get_mut(&row.aggregate_id) {
                    chain.in_flight = false;
                    if chain.queue.is_empty() {
                        self.chains.remove(&row.aggregate_id);
                    } else {
                        self.ready.push_back(row.aggregate_id.clone());
                    }
                }
            }
            Ok(Ok(Confirmation::Nack(_))) => {
                self.refused(row, FailureReason::Nack, "nacked by broker".into())
                    .await;
                self.nacks_in_a_row += 1;
                if self.nacks_in_a_row >= NACKS_BEFORE_RECONNECT {
                    // After a cluster node died, a channel can go on nacking although the queue
                    // has a new leader: start over on a fresh connection (the next node).
                    self.nacks_in_a_row = 0;
                    self.link_failed(
                        FailureReason::Connection,
                        "the broker nacked several publishes in a row; reconnecting",
                    )
                    .await;
                }
            }
            Ok(Ok(Confirmation::NotRequested)) => {
                self.claimed.remove(&row.seq);
                self.link_failed(FailureReason::Connection, "channel not in confirm mode")
                    .await;
            }
            Ok(Err(e)) => match broker_refusal(&e) {
                Some(why) if self.isolation.is_some() && self.in_flight.is_empty() => {
                    // It was alone on the wire: the refusal is this row's.
                    self.refused(row, FailureReason::BrokerRefused, why).await;
                    // The broker closed the channel; the next turn opens another.
                    self.publisher.drop_channel().await;
                }
                Some(why) => {
                    // One of the rows in flight made the broker close the channel: find which, by
                    // sending them (given back below, claimed again) one at a time.
                    let mut suspects = std::mem::take(&mut self.in_flight);
                    suspects.insert(row.seq);
                    tracing::warn!(%why, rows = suspects.len(), "the broker refused a message; sending the rows that were in flight one at a time to find it");
                    self.isolation = Some(Isolation {
                        suspects,
                        until: Instant::now() + ISOLATION_LIMIT,
                    });
                    self.claimed.remove(&row.seq);
                    self.channel_failed(&why).await;
                }
                None => {
                    self.claimed.remove(&row.seq);
                    self.link_failed(FailureReason::Connection, &e.to_string())
                        .await;
                }
            },
            Err(_) => {
                // A timeout is the link's (a quorum queue without a leader, a stalled path), not
                // the row's: charging it would kill rows during an outage. The culprits that do
                // exist, refusals, close the channel right after the body arrives, well within it.
                self.claimed.remove(&row.seq);
                let why = format!("no confirm within {:?}", self.opts.confirm_timeout());
                self.link_failed(FailureReason::ConfirmTimeout, &why).await;
            }
        }
    }

    /// The broker refused a row: charge it an attempt, hold its partition back.
    async fn refused(&mut self, row: OutboxRow, reason: FailureReason, error: String) {
        internal_events::publish_failed(reason, 1);
        self.claimed.remove(&row.seq);
        if let Some(chain) = self.chains.get_mut(&row.aggregate_id) {
            chain.in_flight = false;
        }
        self.give_back_partition(row.partition);
        let attempt = (row.attempts + 1).max(1) as u32;
        let retry_in = self.opts.retry_delay(attempt);
        let trace_id =
            shared::trace::trace_id(row.headers.get("traceparent").and_then(|v| v.as_str()))
                .unwrap_or("");
        match plumbing::db::bounded(store::record_failure(
            self.pool,
            self.leases.schema(),
            row.seq,
            row.partition,
            &error,
            Charge::Attempt {
                max_attempts: self.opts.max_attempts,
                retry_in,
            },
        ))
        .await
        {
            Ok(store::FailedState::Dead) => {
                internal_events::rows_dead(1);
                tracing::error!(message_id = %row.id, trace_id, seq = row.seq, %error, attempts = attempt, "row is dead after max attempts");
            }
            Ok(store::FailedState::Retry) => {
                self.blocked
                    .insert(row.partition, Instant::now() + retry_in);
                tracing::warn!(message_id = %row.id, trace_id, seq = row.seq, reason = reason.as_str(), %error, attempt, ?retry_in, "publish failed; partition held back until retry");
            }
            Err(e) => {
                // Not recorded: the row stays pending and is retried without a charge, after a pause.
                self.blocked
                    .insert(row.partition, Instant::now() + retry_in);
                tracing::warn!(error = %ErrorChain(&e), message_id = %row.id, trace_id, seq = row.seq, "recording a failed publish failed");
            }
        }
    }

    /// Gives every unsent row of a partition back to the outbox (it stays pending there).
    fn give_back_partition(&mut self, partition: i16) {
        self.generation += 1;
        let claimed = &mut self.claimed;
        self.chains.retain(|_, chain| {
            if chain.partition != partition {
                return true;
            }
            for row in chain.queue.drain(..) {
                claimed.remove(&row.seq);
            }
            chain.in_flight
        });
    }

    /// Gives back everything not yet sent (at shutdown).
    fn give_back_unsent(&mut self) {
        self.generation += 1;
        let claimed = &mut self.claimed;
        self.chains.retain(|_, chain| {
            for row in chain.queue.drain(..) {
                claimed.remove(&row.seq);
            }
            chain.in_flight
        });
        self.ready.clear();
    }

    /// The link failed: every unconfirmed row goes back to the outbox, nothing is charged.
    async fn link_failed(&mut self, reason: FailureReason, error: &str) {
        self.give_back_unconfirmed(reason, error);
        self.publisher.disconnect().await;
        self.set_ready(None, Some(false));
        self.amqp_failures += 1;
        self.back_off(self.amqp_failures);
    }

    /// The broker closed the channel over a message: as [`Self::link_failed`], but the connection
    /// stays and the next turn opens a new channel on it at once.
    async fn channel_failed(&mut self, error: &str) {
        self.give_back_unconfirmed(FailureReason::Connection, error);
        self.publisher.drop_channel().await;
    }

    fn give_back_unconfirmed(&mut self, reason: FailureReason, error: &str) {
        self.generation += 1;
        let unconfirmed = self.confirms.len();
        self.confirms = FuturesUnordered::new();
        self.in_flight.clear();
        self.chains.clear();
        self.ready.clear();
        let keep: HashSet<i64> = self
            .to_mark
            .iter()
            .chain(self.marking.iter().flat_map(|(_, seqs)| seqs.iter()))
            .copied()
            .collect();
        self.claimed.retain(|seq, _| keep.contains(seq));
        internal_events::publish_failed(reason, unconfirmed.max(1));
        tracing::warn!(%error, unconfirmed, "broker link failed; unconfirmed rows stay pending");
    }

    async fn on_marked(&mut self, result: Result<(), String>) {
        let (_, seqs) = self.marking.take().expect("a mark was running");
        match result {
            Ok(()) => {
                self.db_failures = 0;
                internal_events::published(seqs.len());
                let claim_running = self.claiming.is_some();
                for seq in &seqs {
                    self.claimed.remove(seq);
                    if claim_running {
                        self.marked_during_claim.insert(*seq);
                    }
                }
                if !self.retried.is_empty() {
                    let done: HashSet<i64> = seqs.iter().copied().collect();
                    let (now, later): (Vec<i64>, Vec<i64>) =
                        self.retried.iter().partition(|s| done.contains(s));
                    self.retried = later;
                    if !now.is_empty()
                        && let Err(e) = plumbing::db::bounded(store::unblock_published(
                            self.pool,
                            self.leases.schema(),
                            &now,
                        ))
                        .await
                    {
                        tracing::warn!(error = %ErrorChain(&e), "unblocking partitions failed; they unblock when the backoff ends");
                    }
                }
            }
            Err(e) => {
                self.db_failures += 1;
                self.set_ready(Some(false), None);
                tracing::warn!(error = %e, rows = seqs.len(), "marking published rows failed; retrying");
                self.to_mark.extend(seqs);
                self.back_off(self.db_failures);
            }
        }
    }

    /// Hands surplus partitions to other relays once nothing of theirs is claimed here.
    async fn rebalance(&mut self) {
        self.releasing.extend(self.leases.take_surplus());
        if self.releasing.is_empty() {
            return;
        }
        let busy: HashSet<i16> = self.claimed.values().copied().collect();
        let free: Vec<i16> = self
            .releasing
            .iter()
            .copied()
            .filter(|p| !busy.contains(p))
            .collect();
        if free.is_empty() {
            return;
        }
        match plumbing::db::bounded(self.leases.release(self.pool, &free)).await {
            Ok(()) => {
                tracing::info!(partitions = ?free, "gave partitions back for rebalancing");
                for p in &free {
                    self.releasing.remove(p);
                }
            }
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "releasing partitions failed"),
        }
    }
}

/// The reason, when the broker closed the channel or connection over a message it refused
/// (PRECONDITION_FAILED such as a message over `max_message_size`, a frame or syntax error) rather
/// than over the link, its topology or its permissions (those are retried without charging a row).
fn broker_refusal(e: &lapin::Error) -> Option<String> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.get_id(), 406 | 501 | 502 | 503 | 505) =>
        {
            Some(format!(
                "refused by the broker: {} {}",
                amqp.get_id(),
                amqp.get_message().as_str()
            ))
        }
        _ => None,
    }
}

fn flatten<T>(r: Result<Result<T, sqlx::Error>, tokio::task::JoinError>) -> Result<T, String> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ErrorChain(&e).to_string()),
        Err(e) => Err(format!("task failed: {e}")),
    }
}

/// The span of one publish: exported (under the message's trace) only when OTLP is on; otherwise a
/// debug span, which costs nothing unless debug logging is enabled.
fn publish_span(row: &OutboxRow) -> tracing::Span {
    let traceparent = row.headers.get("traceparent").and_then(|v| v.as_str());
    if plumbing::telemetry::otlp_enabled() {
        let span = tracing::info_span!(
            "publish",
            message_id = %row.id,
            trace_id = shared::trace::trace_id(traceparent).unwrap_or(""),
            seq = row.seq
        );
        if let Some(tp) = traceparent {
            plumbing::trace::set_parent(&span, tp);
        }
        span
    } else {
        tracing::debug_span!(
            "publish",
            message_id = %row.id,
            trace_id = shared::trace::trace_id(traceparent).unwrap_or(""),
            seq = row.seq
        )
    }
}
