//! The publishing pipeline: claiming, publishing and marking overlap, so the broker always has a
//! window of publishes to confirm.
//!
//! Its parts, each a plain type with its own tests:
//! - [`claims`]: what this relay holds from the outbox, how much of each partition a claim asks for;
//! - [`positions`]: where each partition's claim starts (past what it has read, below what it gave
//!   back) and which transactions may still commit rows below that, so a claim never re-reads
//!   what an old snapshot keeps in the index;
//! - [`chains`]: per-aggregate order: which held rows may go now, many of one aggregate in flight,
//!   what a refusal in the middle of a chain gives back;
//! - [`window`]: the publishes in flight, their confirms and what each one means;
//! - [`marks`]: confirmed rows on their way to being marked published;
//! - [`gate`]: partitions blocked after a refusal or being released;
//! - [`health`]: PostgreSQL and RabbitMQ readiness and backoff.
//!
//! This file is the loop that ties them: one event at a time (a confirm, a claim's or a mark's
//! result, a wake-up), and between events it connects, fills the window and starts database work.
//!
//! Failures: a refused row (nack, return) is charged an attempt, rewinds its chain (see
//! [`chains`]) and blocks its partition for the retry backoff (locally and in `relay_partitions`,
//! so any relay respects it). A link failure gives back everything unconfirmed, charging nothing.
//! A channel closed by a refusal sends the rows that were in flight again one at a time, so the one
//! to blame is found and charged.

mod chains;
mod claims;
mod gate;
mod health;
mod marks;
mod positions;
mod window;

use crate::RelayOptions;
use crate::cloudevents;
use crate::encoder::{self, Encoded, Encoding};
use crate::internal_events::{self, DbOp, FailureReason};
use crate::leases::Leases;
use crate::publisher::{self, Publisher};
use crate::store::{self, Charge, Claimed, OutboxRow};
use chains::{Acked, Chains};
use claims::{Admit, ClaimPlan, Claims};
use gate::Gate;
use health::Health;
use marks::Marks;
use plumbing::telemetry::{ErrorChain, Readiness};
use sqlx::PgPool;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use window::{ConfirmResult, Verdict, Window};

/// A running claim.
/// A claim's rows and the snapshot taken just before it (`pg_current_snapshot()` as text).
type ClaimTask = JoinHandle<Result<(Vec<Claimed>, String), sqlx::Error>>;
/// A written batch: its rows, each publish's confirm (or why it was not sent), when it went.
type SentBatch = (
    Vec<OutboxRow>,
    Vec<Result<lapin::PublisherConfirm, lapin::Error>>,
    Instant,
);
/// A batch lapin has not written yet (it writes nothing while the broker blocks the connection,
/// nor while the broker reads nothing), and since when. Its rows are in the window already.
type Sending = (Pin<Box<dyn Future<Output = SentBatch> + Send>>, Instant);
/// How long a stopping relay keeps trying to mark confirmed rows, beyond the confirm timeout.
const STOP_GRACE: Duration = Duration::from_secs(5);

enum Event {
    Sent(Box<SentBatch>),
    Confirm(Box<(OutboxRow, ConfirmResult, Instant)>),
    Claimed(Result<(Vec<Claimed>, String), String>),
    Marked(Result<(), String>),
    Wake,
    Stop,
}

pub(crate) struct Pipeline<'a> {
    pool: &'a PgPool,
    publisher: Publisher,
    leases: &'a Leases,
    wake: &'a Notify,
    opts: &'a RelayOptions,
    /// CloudEvents binary mode, checked at start; `None` when off.
    cloudevents: Option<Arc<cloudevents::Binary>>,
    /// Prepared claims and marks on a direct session, unnamed through a transaction pooler.
    statements: store::Statements,
    health: Health<'a>,
    claims: Claims,
    /// The running claim and what it asked for.
    claiming: Option<(ClaimTask, ClaimPlan)>,
    chains: Chains,
    /// The batch being written; the next waits for it, so frames go out in batch order.
    sending: Option<Sending>,
    window: Window,
    marks: Marks,
    gate: Gate,
    /// Set after [`health::NACKS_BEFORE_RECONNECT`] nacks in a row: nothing more is sent, the
    /// window settles (every nack charged, every ack marked), then the connection is replaced.
    replace_link: bool,
}

impl<'a> Pipeline<'a> {
    pub(crate) fn new(
        pool: &'a PgPool,
        publisher: Publisher,
        leases: &'a Leases,
        wake: &'a Notify,
        readiness: &'a Readiness,
        opts: &'a RelayOptions,
        cloudevents: Option<Arc<cloudevents::Binary>>,
    ) -> Self {
        Self {
            pool,
            publisher,
            leases,
            wake,
            opts,
            cloudevents,
            statements: store::Statements::default(),
            health: Health::new(readiness),
            claims: Claims::new(),
            claiming: None,
            chains: Chains::default(),
            sending: None,
            window: Window::new(opts.window as usize),
            marks: Marks::default(),
            gate: Gate::default(),
            replace_link: false,
        }
    }

    /// How the claim and the mark reach PostgreSQL (unnamed statements through a transaction
    /// pooler).
    pub(crate) fn with_statements(mut self, statements: store::Statements) -> Self {
        self.statements = statements;
        self
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
            self.turn(stopping).await;
            if stopping && self.settled() {
                break;
            }
            let event = self.next_event(shutdown, &mut poll, stop_by).await;
            self.handle(event).await;
        }
        self.publisher
    }

    /// The work between two events: connect, release, send, start claims and marks.
    async fn turn(&mut self, stopping: bool) {
        let backoff_over = self.health.backoff_over(Instant::now());
        if !stopping && backoff_over && self.in_flight() == 0 && !self.publisher.is_connected() {
            self.connect().await;
        }
        self.watch_blocked();
        if self.replace_link && self.in_flight() == 0 {
            self.replace_link = false;
            self.link_failed(
                FailureReason::Connection,
                "the broker nacked several publishes in a row; reconnecting",
            )
            .await;
        }
        if !stopping && !self.replace_link {
            self.rebalance().await;
            self.fill_window().await;
        }
        if self.health.retry_at().is_none() {
            self.marks.start(
                self.pool,
                self.leases.schema(),
                self.opts.retention_secs > 0,
                self.statements,
            );
        }
        if !stopping && self.claim_due() {
            self.start_claim();
        }
    }

    fn settled(&self) -> bool {
        self.in_flight() == 0 && self.marks.is_idle() && self.claiming.is_none()
    }

    /// Rows sent and not settled: being written, or waiting for their confirm.
    fn in_flight(&self) -> usize {
        self.window.len()
    }

    async fn next_event(
        &mut self,
        shutdown: &CancellationToken,
        poll: &mut tokio::time::Interval,
        stop_by: Option<Instant>,
    ) -> Event {
        let stopping = shutdown.is_cancelled();
        let retry_at = self.health.retry_at();
        let confirms_pending = self.window.awaits_confirms();
        let send_running = self.sending.is_some();
        let (sending, window, claiming, marking) = (
            futures::future::OptionFuture::from(self.sending.as_mut().map(|(batch, _)| batch)),
            &mut self.window,
            self.claiming.as_mut().map(|(task, _)| task),
            self.marks.running(),
        );
        let claim_running = claiming.is_some();
        let mark_running = marking.is_some();
        tokio::select! {
            Some(r) = sending, if send_running => Event::Sent(Box::new(r)),
            Some(c) = window.next(), if confirms_pending => Event::Confirm(Box::new(c)),
            r = async { claiming.expect("guarded").await }, if claim_running => Event::Claimed(flatten(r)),
            r = async { marking.expect("guarded").await }, if mark_running => Event::Marked(flatten(r)),
            _ = self.wake.notified(), if !stopping => Event::Wake,
            _ = poll.tick(), if !stopping => Event::Wake,
            _ = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if retry_at.is_some() => Event::Wake,
            _ = shutdown.cancelled(), if !stopping => Event::Stop,
            _ = tokio::time::sleep_until(stop_by.unwrap_or_else(Instant::now)), if stop_by.is_some() => Event::Stop,
        }
    }

    async fn handle(&mut self, event: Event) {
        match event {
            Event::Sent(batch) => {
                self.sending = None;
                let (rows, results, sent) = *batch;
                self.on_sent(rows, results, sent).await;
            }
            Event::Confirm(first) => self.on_confirms(*first).await,
            Event::Claimed(result) => {
                if let Some((_, plan)) = self.claiming.take() {
                    self.on_claimed(result, plan).await;
                }
            }
            Event::Marked(result) => self.on_marked(result).await,
            Event::Wake => self.claims.more = true,
            Event::Stop => {}
        }
    }

    /// The shutdown deadline passed: stop waiting for confirms and the database. Nothing is lost:
    /// every row not marked is still pending in the outbox.
    fn abandon_at_stop(&mut self) {
        let unmarked = self.marks.abandon();
        if let Some((task, _)) = self.claiming.take() {
            task.abort();
        }
        tracing::warn!(
            unconfirmed = self.in_flight(),
            unmarked,
            "stopping before everything was settled: these rows stay pending and will be published again"
        );
    }

    /// Follows `connection.blocked` / `connection.unblocked` (checked every turn; the poll tick
    /// guarantees a turn at least every poll interval): blocked means not ready.
    ///
    /// A batch lapin could not write within the confirm timeout counts as blocked too: RabbitMQ
    /// blocks by no longer reading the socket, and does not always say so (3.10.8, under a memory
    /// alarm, stopped reading a connection in the middle of a 32 MB batch, listed it as `blocked`,
    /// and sent no `connection.blocked`). It unblocks when the batch is written.
    fn watch_blocked(&mut self) {
        let stalled = self
            .sending
            .as_ref()
            .is_some_and(|(_, since)| since.elapsed() >= self.opts.confirm_timeout());
        let blocked = self.publisher.is_blocked() || stalled;
        if !self
            .health
            .set_blocked(blocked, self.publisher.is_connected())
        {
            return;
        }
        if blocked {
            tracing::warn!(
                in_flight = self.window.len(),
                stalled,
                "RabbitMQ blocked publishing (resource alarm, or it reads nothing more); waiting for it to unblock"
            );
        } else {
            tracing::info!("RabbitMQ unblocked publishing");
            self.claims.more = true;
        }
    }

    async fn connect(&mut self) {
        match self.publisher.ensure_connected().await {
            Ok(()) => {
                self.health.amqp_ok();
                self.claims.more = true;
            }
            Err(e) => {
                let attempt = self.health.amqp_failed();
                internal_events::reconnect("rabbitmq");
                tracing::warn!(error = %ErrorChain(&e), attempt, "RabbitMQ unavailable; retrying");
            }
        }
    }

    fn claim_due(&self) -> bool {
        self.claims.more
            && !self.replace_link
            && self.claiming.is_none()
            && self.health.retry_at().is_none()
            && self.publisher.is_connected()
            && !self.health.broker_blocked
            && self.claims.len() < 2 * self.opts.batch_size as usize
    }

    fn start_claim(&mut self) {
        for p in self.leases.take_taken() {
            self.claims.taken_over(p);
        }
        let need = self.opts.confirm_timeout() + self.opts.lease() / 10;
        let (owned, _) = self.leases.usable(need);
        let mut partitions = self.gate.open(owned, Instant::now());
        let rewinding: HashSet<i16> = self.chains.rewinding().collect();
        partitions.retain(|p| !rewinding.contains(p));
        if partitions.is_empty() {
            self.claims.more = false;
            return;
        }
        let plan = self
            .claims
            .plan(partitions, i64::from(self.opts.batch_size));
        let (pool, schema) = (self.pool.clone(), self.leases.schema().clone());
        let owner = self.leases.instance_id.clone();
        let args = plan.clone();
        let statements = self.statements;
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let rows = plumbing::db::bounded(store::claim(
                &pool,
                &schema,
                &owner,
                &store::ClaimArgs {
                    partitions: &args.partitions,
                    per_partition: &args.limits,
                    floors: &args.floors,
                    limit: args.limit,
                    held: &args.held,
                    late_running: &args.late.running,
                    late_from: args.late.from.as_deref(),
                    statements,
                },
            ))
            .await;
            internal_events::db_duration(DbOp::Claim, started.elapsed());
            rows
        });
        self.claiming = Some((task, plan));
    }

    async fn on_claimed(
        &mut self,
        result: Result<(Vec<Claimed>, String), String>,
        plan: ClaimPlan,
    ) {
        let batch = i64::from(self.opts.batch_size);
        let (claimed, snapshot) = match result {
            Ok(r) => r,
            Err(e) => {
                let attempt = self.health.db_failed();
                internal_events::reconnect("postgres");
                tracing::warn!(error = %e, attempt, "claim failed; retrying");
                self.claims.returned(&plan, None, batch);
                return;
            }
        };
        self.health.db_ok();
        let mut counts: HashMap<i16, i64> = HashMap::new();
        for item in &claimed {
            *counts.entry(item.partition()).or_default() += 1;
        }
        if !self.claims.returned(&plan, Some(&counts), batch) {
            self.claims.admitted();
            return;
        }
        // Where each partition's next claim starts, and what it watches below that.
        match positions::Snapshot::parse(&snapshot) {
            Some(snapshot) => {
                let rows: Vec<(i16, i64)> =
                    claimed.iter().map(|c| (c.partition(), c.seq())).collect();
                self.claims.positioned(&plan, &rows, &snapshot);
            }
            None => tracing::warn!(%snapshot, "claim snapshot not understood; positions kept"),
        }
        if claimed.is_empty() {
            self.claims.admitted();
            return;
        }
        internal_events::batch_claimed(claimed.len());
        let wall = chrono::Utc::now();
        let now = Instant::now();
        for item in claimed {
            match item {
                Claimed::Undecodable {
                    seq,
                    partition,
                    reason,
                } => {
                    if self.claims.admit(seq) == Admit::Take {
                        self.bury(seq, partition, None, &reason).await;
                    }
                }
                Claimed::Row(row) => {
                    internal_events::claim_lag(
                        (wall - row.created_at).to_std().unwrap_or_default(),
                    );
                    if self.claims.admit(row.seq) == Admit::Take {
                        if self.gate.is_open(row.partition, now) {
                            self.claims.hold(row.seq, row.partition);
                            self.chains.add(row);
                        } else {
                            self.claims.not_taken(row.partition, row.seq);
                        }
                    }
                }
            }
        }
        self.claims.admitted();
    }

    /// Marks a row dead at once because it can never be published as it is (it broke a rule, does
    /// not fit, or cannot be decoded). It holds nothing back from then on. If the mark fails, the
    /// row stays pending and its partition waits a retry delay before it is tried again.
    async fn bury(&mut self, seq: i64, partition: i16, id: Option<uuid::Uuid>, reason: &str) {
        internal_events::publish_failed(FailureReason::Unpublishable, 1);
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
                self.claims.buried(seq);
                internal_events::rows_dead(1);
                tracing::error!(%message_id, seq, partition, %reason, "row can never be published as it is: marked dead");
            }
            Err(e) => {
                self.claims.release(seq);
                self.give_back_partition(partition);
                self.gate
                    .block(partition, Instant::now() + self.opts.retry_delay(1));
                tracing::warn!(error = %ErrorChain(&e), %message_id, seq, %reason, "marking an unpublishable row dead failed; its partition waits");
            }
        }
    }

    /// Sends ready rows while the window has room: many of one aggregate back to back, in seq
    /// order (one channel keeps publish order in every queue).
    async fn fill_window(&mut self) {
        let room = self.window.room(Instant::now());
        if room == 0 || self.health.broker_blocked || self.sending.is_some() {
            return;
        }
        let Some(frame_max) = self.publisher.frame_max() else {
            return;
        };
        let limits = Encoding {
            frame_max,
            max_payload_bytes: usize::try_from(self.opts.max_payload_bytes).unwrap_or(usize::MAX),
            cloudevents: self.cloudevents.clone(),
        };
        let mut batch: Vec<(OutboxRow, Encoded)> = Vec::new();
        let mut unpublishable: Vec<(OutboxRow, String)> = Vec::new();
        while batch.len() < room && self.publisher.is_connected() {
            let Some((aggregate, partition)) = self.chains.next_ready() else {
                break;
            };
            if !self.lease_outlasts_confirm(partition) {
                self.give_back_partition(partition);
                continue;
            }
            let Some(row) = self.chains.pop_next(&aggregate) else {
                continue;
            };
            match encoder::encode(&row, &limits) {
                Ok(encoded) => {
                    self.chains.sent(&row);
                    batch.push((row, encoded));
                }
                Err(e) => {
                    // Dead, so it holds nothing back: the aggregate's next row may go.
                    self.chains.skipped(&aggregate);
                    unpublishable.push((row, format!("unpublishable: {e}")));
                }
            }
        }
        for (row, reason) in unpublishable {
            self.bury(row.seq, row.partition, Some(row.id), &reason)
                .await;
        }
        self.publish(batch).await;
    }

    /// The lease must outlast the confirm, or another relay could publish the partition too.
    fn lease_outlasts_confirm(&self, partition: i16) -> bool {
        let need = Instant::now() + self.opts.confirm_timeout();
        self.leases
            .valid_until(partition)
            .is_some_and(|until| until > need)
    }

    /// Hands `batch` to lapin at once: each publish waits until lapin's I/O thread has written its
    /// frames, so sending one at a time costs two thread hand-offs per message, while a whole
    /// batch is written and acknowledged in one. lapin numbers a publish for its confirm and
    /// queues its frames in the same poll, in the order of the batch, so confirms match their
    /// rows and the rows of one aggregate go out in seq order.
    ///
    /// The batch is polled once here (that queues it) and then by the loop as an event, never
    /// awaited in place: lapin writes nothing while the broker blocks the connection, and the
    /// loop must go on meanwhile (report the block, mark what was confirmed, stop when asked).
    async fn publish(&mut self, batch: Vec<(OutboxRow, Encoded)>) {
        if batch.is_empty() {
            return;
        }
        let sent = Instant::now();
        let (rows, encoded): (Vec<OutboxRow>, Vec<Encoded>) = batch.into_iter().unzip();
        self.window.sent(rows.iter().map(|row| row.seq));
        let Some(sender) = self.publisher.sender() else {
            let results = rows.iter().map(|_| Err(publisher::closed())).collect();
            return self.on_sent(rows, results, sent).await;
        };
        let mut writing: Pin<Box<dyn Future<Output = SentBatch> + Send>> = Box::pin(async move {
            let results =
                futures::future::join_all(rows.iter().zip(encoded).map(|(row, encoded)| {
                    sender
                        .send(encoded, row.payload.as_bytes())
                        .instrument(publish_span(row))
                }))
                .await;
            (rows, results, sent)
        });
        match futures::poll!(writing.as_mut()) {
            Poll::Ready((rows, results, sent)) => self.on_sent(rows, results, sent).await,
            Poll::Pending => self.sending = Some((writing, sent)),
        }
    }

    /// A batch is written: its confirms join the window; a publish lapin refused fails the link.
    async fn on_sent(
        &mut self,
        rows: Vec<OutboxRow>,
        results: Vec<Result<lapin::PublisherConfirm, lapin::Error>>,
        sent: Instant,
    ) {
        let status = self.publisher.status();
        let timeout = self.opts.confirm_timeout();
        let mut failure = None;
        for (row, result) in rows.into_iter().zip(results) {
            match result {
                Ok(confirm) => {
                    let status = status.clone();
                    self.window.push(Box::pin(async move {
                        tokio::pin!(confirm);
                        // A blocked connection is not a dead one: its confirms come after the
                        // unblock (a lost link still ends the wait with an error).
                        let result = loop {
                            match tokio::time::timeout(timeout, confirm.as_mut()).await {
                                Err(_) if status.as_ref().is_some_and(|s| s.blocked()) => {
                                    continue;
                                }
                                r => break r,
                            }
                        };
                        (row, result, sent)
                    }));
                }
                Err(e) => {
                    self.claims.release(row.seq);
                    failure.get_or_insert(e.to_string());
                }
            }
        }
        if let Some(e) = failure {
            // Everything unconfirmed, including what was just sent, goes back to the outbox.
            self.link_failed(FailureReason::Connection, &e).await;
        }
    }

    /// Settles every confirm ready now, acks first. Once the link is dropped (which empties the
    /// window), the rest of the batch are answers of that link (its closing error, seen by every
    /// publish in flight), not of their rows: those rows went back to the outbox with it.
    async fn on_confirms(&mut self, first: (OutboxRow, ConfirmResult, Instant)) {
        for (row, result) in self.window.ready_batch(first) {
            if self.window.settle(&row) {
                self.on_confirm(row, result).await;
            }
        }
        self.window.forget_returns_if_idle();
    }

    async fn on_confirm(&mut self, row: OutboxRow, result: ConfirmResult) {
        let returned = self.window.take_return(&row);
        let verdict = window::verdict(result, returned, self.opts.confirm_timeout());
        match verdict {
            Verdict::Ack => self.acked(row),
            Verdict::Refused { .. } if self.chains.take_doomed(&row) => {
                // Sent after a refused row of its aggregate: it goes back uncharged.
                self.claims.release(row.seq);
            }
            Verdict::Refused { reason, why } => {
                self.refused(row, reason, why).await;
                if reason == FailureReason::Nack && self.health.nacked() {
                    // After a cluster node died, a channel can go on nacking although the queue
                    // has a new leader: start over on a fresh connection (the next node). First
                    // the publishes in flight settle, so every nack among them is charged and a
                    // later row of a refused one's aggregate is never sent again uncharged (an
                    // overtake nobody could tell from a refusal). A channel that answers nothing
                    // any more ends in the confirm timeout, a link failure.
                    self.replace_link = true;
                }
            }
            Verdict::ChannelClosed(why) if self.window.was_alone() => {
                // It was alone on the wire: the refusal is this row's.
                self.refused(row, FailureReason::BrokerRefused, why).await;
                // The broker closed the channel; the next turn opens another.
                self.publisher.drop_channel().await;
            }
            Verdict::ChannelClosed(why) => {
                // One of the rows in flight made the broker close the channel: find which, by
                // sending them (given back below, claimed again) one at a time.
                let rows = self.window.isolate(row.seq);
                tracing::warn!(%why, rows, "the broker refused a message; sending the rows that were in flight one at a time to find it");
                self.claims.release(row.seq);
                self.give_back_unconfirmed(FailureReason::Connection, &why);
                self.publisher.drop_channel().await;
            }
            Verdict::LinkFailed { reason, why } => {
                self.claims.release(row.seq);
                self.link_failed(reason, &why).await;
            }
        }
    }

    fn acked(&mut self, row: OutboxRow) {
        self.health.acked();
        match self.chains.acked(&row) {
            Acked::GiveBack => self.claims.release(row.seq),
            Acked::Mark(markable) => {
                let latency = (chrono::Utc::now() - row.created_at)
                    .to_std()
                    .unwrap_or_default();
                internal_events::publish_latency(latency);
                for m in markable {
                    self.marks.push(m);
                }
            }
        }
    }

    /// The broker refused a row: charge it an attempt, rewind its chain, hold its partition back.
    async fn refused(&mut self, row: OutboxRow, reason: FailureReason, error: String) {
        internal_events::publish_failed(reason, 1);
        self.claims.release(row.seq);
        let back = self.chains.refused(&row);
        self.claims.gave_back(back);
        self.give_back_partition(row.partition);
        let attempt = (row.attempts + 1).max(1) as u32;
        let retry_in = self.opts.retry_delay(attempt);
        let trace_id =
            shared::trace::trace_id(row.headers.get("traceparent").and_then(|v| v.as_str()))
                .unwrap_or("");
        let charge = Charge::Attempt {
            max_attempts: self.opts.max_attempts,
            retry_in,
        };
        let recorded = plumbing::db::bounded(store::record_failure(
            self.pool,
            self.leases.schema(),
            row.seq,
            row.partition,
            &error,
            charge,
        ))
        .await;
        match recorded {
            Ok(store::FailedState::Dead) => {
                internal_events::rows_dead(1);
                tracing::error!(message_id = %row.id, trace_id, seq = row.seq, aggregate_seq = row.aggregate_seq, %error, attempts = attempt, "row is dead after max attempts");
            }
            Ok(store::FailedState::Retry) => {
                self.gate.block(row.partition, Instant::now() + retry_in);
                tracing::warn!(message_id = %row.id, trace_id, seq = row.seq, aggregate_seq = row.aggregate_seq, reason = reason.as_str(), %error, attempt, ?retry_in, "publish failed; partition held back until retry");
            }
            Err(e) => {
                // Not recorded: the row stays pending and is retried without a charge, after a pause.
                self.gate.block(row.partition, Instant::now() + retry_in);
                tracing::warn!(error = %ErrorChain(&e), message_id = %row.id, trace_id, seq = row.seq, "recording a failed publish failed");
            }
        }
    }

    /// Gives every unsent row of a partition back to the outbox (it stays pending there).
    fn give_back_partition(&mut self, partition: i16) {
        let back = self.chains.give_back_partition(partition);
        self.claims.gave_back(back);
    }

    /// Gives back everything not yet sent (at shutdown).
    fn give_back_unsent(&mut self) {
        let back = self.chains.give_back_unsent();
        self.claims.gave_back(back);
    }

    /// The link failed: every unconfirmed row goes back to the outbox, nothing is charged.
    async fn link_failed(&mut self, reason: FailureReason, error: &str) {
        self.replace_link = false;
        self.give_back_unconfirmed(reason, error);
        self.publisher.disconnect().await;
        self.health.amqp_failed();
    }

    fn give_back_unconfirmed(&mut self, reason: FailureReason, error: &str) {
        // A batch still being written goes back too: its frames die with the link or channel.
        self.sending = None;
        let unconfirmed = self.window.clear();
        self.chains.clear();
        let keep = self.marks.unmarked();
        self.claims.retain(|seq| keep.contains(&seq));
        internal_events::publish_failed(reason, unconfirmed.max(1));
        tracing::warn!(%error, unconfirmed, "broker link failed; unconfirmed rows stay pending");
    }

    async fn on_marked(&mut self, result: Result<(), String>) {
        let ok = result.is_ok();
        let (seqs, unblock) = self.marks.finished(ok);
        if let Err(e) = result {
            let attempt = self.health.db_failed();
            tracing::warn!(error = %e, rows = seqs.len(), attempt, "marking published rows failed; retrying");
            return;
        }
        self.health.db_ok();
        internal_events::published(seqs.len());
        self.claims.marked(&seqs);
        if !unblock.is_empty()
            && let Err(e) = plumbing::db::bounded(store::unblock_published(
                self.pool,
                self.leases.schema(),
                &unblock,
            ))
            .await
        {
            tracing::warn!(error = %ErrorChain(&e), "unblocking partitions failed; they unblock when the backoff ends");
        }
    }

    /// Hands surplus partitions to other relays once nothing of theirs is held here.
    async fn rebalance(&mut self) {
        self.gate.start_releasing(self.leases.take_surplus());
        if !self.gate.is_releasing() {
            return;
        }
        let free = self.gate.releasable(&self.claims.busy_partitions());
        if free.is_empty() {
            return;
        }
        match plumbing::db::bounded(self.leases.release(self.pool, &free)).await {
            Ok(()) => {
                tracing::info!(partitions = ?free, "gave partitions back for rebalancing");
                self.gate.released(&free);
            }
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "releasing partitions failed"),
        }
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
    let trace_id = shared::trace::trace_id(traceparent).unwrap_or("");
    if plumbing::telemetry::otlp_enabled() {
        let span = tracing::info_span!(
            "publish",
            message_id = %row.id,
            trace_id,
            seq = row.seq,
            aggregate_seq = row.aggregate_seq
        );
        if let Some(tp) = traceparent {
            plumbing::trace::set_parent(&span, tp);
        }
        span
    } else {
        tracing::debug_span!("publish", message_id = %row.id, trace_id, seq = row.seq)
    }
}
