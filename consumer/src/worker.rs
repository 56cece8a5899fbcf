//! A worker: one consuming channel and one confirming publishing channel. It takes what the broker
//! has buffered (up to `batch_size`), decides each delivery's work before the transaction, runs
//! the batch (see [`crate::batch`]) with retries while the database fails, publishes the copies
//! (see [`crate::copies`]), then acknowledges the whole batch at once.

use crate::batch::{self, Fate, Item, Work};
use crate::broker_headers;
use crate::config::Config;
use crate::context::{BROKER_TIMEOUT, Ctx, bounded};
use crate::copies;
use crate::error::SessionError;
use crate::internal_events::{Events, Outcome};
use crate::links::Links;
use crate::message::{self, DeadLetterKind};
use crate::ordered::apply::ApplyError;
use crate::ordered::group::Slot;
use crate::screen::{self, Reason};
use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, PublisherConfirm};
use plumbing::broker_version::BrokerVersion;
use plumbing::telemetry::{ErrorChain, Readiness};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Resolves once `stop` is cancelled while PostgreSQL does not answer (the consumer's readiness
/// says so: its watch pings every 5 s with a 5 s bound). A stopping worker whose database works
/// finishes its batch (commit, then ack), however slow its handlers; one whose database stopped
/// answering (a black-holed link) leaves the batch unacknowledged instead of waiting for the
/// statement bound.
async fn stopped_without_database(stop: &CancellationToken, readiness: &Readiness) {
    stop.cancelled().await;
    while readiness.postgres() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The `basic.consume` arguments: the consumer timeout where the broker takes one (3.11.15 and
/// later; an unknown or unannounced version gets none).
pub(crate) fn consume_arguments(config: &Config, broker: Option<BrokerVersion>) -> FieldTable {
    let mut args = FieldTable::default();
    if !config.consumer_timeout.is_zero()
        && broker.is_some_and(BrokerVersion::supports_consumer_timeout_argument)
    {
        let ms = i64::try_from(config.consumer_timeout.as_millis()).unwrap_or(i64::MAX);
        args.insert("x-consumer-timeout".into(), AMQPValue::LongLongInt(ms));
    }
    args
}

/// Resolves once the broker has cancelled `consumer` (`basic.cancel`: its queue was deleted, the
/// consumer timeout struck, ...). Polled, because a worker waiting on its database does not
/// read the delivery stream whose end would say so.
async fn cancelled_by_broker(consumer: &lapin::Consumer, by_us: bool) {
    if by_us {
        return std::future::pending().await;
    }
    while !consumer.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub(crate) enum BatchEnd {
    Settled,
    /// Shutdown while the database was unavailable (failing, or not answering the batch's
    /// transaction): left unacknowledged, the broker redelivers.
    Abandoned,
}

pub(crate) struct Worker {
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) events: Events,
    pub(crate) index: usize,
    pub(crate) consume_ch: Channel,
    pub(crate) publish_ch: Channel,
    /// The copies' connection's status: blocked during a broker resource alarm.
    pub(crate) copies: lapin::ConnectionStatus,
    pub(crate) consumer: lapin::Consumer,
    /// The copies' connection's negotiated `frame_max`: a copy's properties must fit one frame.
    pub(crate) frame_max: u32,
    /// Ordered mode: the partition this worker consumes, and the fence its transactions check.
    pub(crate) slot: Option<Slot>,
    /// A fair share's lane this worker works (it handles); `None`: the main queue (with a fair
    /// share, it sorts).
    pub(crate) lane: Option<String>,
    /// The queue consumed and the `basic.consume` arguments, to consume again after a pause.
    pub(crate) queue: String,
    pub(crate) consume_args: FieldTable,
    /// Consuming one message at a time after a pause, until the dependencies let calls go.
    pub(crate) probing: bool,
    /// The first consumer's tag and how many consumers were started since (each new tag is the
    /// first one and the count).
    pub(crate) tag: String,
    pub(crate) consumes: u32,
    /// The consumer was cancelled by this worker (a pause), not by the broker.
    pub(crate) cancelled_by_us: bool,
}

impl Worker {
    pub(crate) async fn open(
        ctx: Arc<Ctx>,
        events: Events,
        links: &Links,
        index: usize,
        slot: Option<Slot>,
        lane: Option<String>,
    ) -> Result<Self, lapin::Error> {
        let conn = &links.consume;
        let consume_ch = conn.create_channel().await?;
        consume_ch
            .basic_qos(ctx.config.prefetch, BasicQosOptions::default())
            .await?;
        let publish_ch = links.publish.create_channel().await?;
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
        let queue = match (slot, &lane) {
            (Some(s), _) => crate::ordered::topology::queue(&ctx.config.name, s.partition),
            (None, Some(lane)) => lane.clone(),
            (None, None) => ctx.topology.queue.clone(),
        };
        let consume_args = consume_arguments(&ctx.config, BrokerVersion::of(conn));
        let consumer = consume_ch
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                consume_args.clone(),
            )
            .await?;
        Ok(Self {
            ctx,
            events,
            index,
            consume_ch,
            publish_ch,
            copies: links.publish.status().clone(),
            consumer,
            frame_max: links.publish.configuration().frame_max(),
            slot,
            lane,
            queue,
            consume_args,
            probing: false,
            tag,
            consumes: 0,
            cancelled_by_us: false,
        })
    }

    pub(crate) async fn run(mut self, stop: CancellationToken) -> Result<(), SessionError> {
        let result = self.consume_loop(&stop).await;
        match &result {
            Ok(()) => self.return_buffered().await,
            Err(e) => {
                tracing::debug!(worker = self.index, error = %ErrorChain(e), "worker stopping")
            }
        }
        // Closing returns every delivery still unacknowledged (after a lost link, or a batch left
        // to redelivery) to the queue.
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

    /// On a graceful stop: cancels the consumer, so that the broker sends nothing more, then
    /// returns every delivery it had sent that no batch took (`basic.nack`, requeue), before the
    /// channel closes. A channel closed with unacknowledged deliveries counts each as a failed
    /// delivery on a quorum queue (on 4.0 to 4.2 against the delivery limit, 20 by default); from
    /// 4.3 a `basic.nack` is "not processed" and leaves the count alone. Best effort: whatever
    /// fails here, the channel close still returns the deliveries.
    async fn return_buffered(&mut self) {
        let tag = self.consumer.tag();
        let cancelled = bounded(
            "cancelling the consumer",
            self.consume_ch
                .basic_cancel(tag, BasicCancelOptions::default()),
            SessionError::Ack,
        )
        .await;
        if let Err(e) = cancelled {
            tracing::debug!(worker = self.index, error = %ErrorChain(&e), "could not cancel the consumer; the channel close returns its deliveries");
            return;
        }
        // After cancel-ok every delivery sent before it is buffered, followed by the stream's end.
        let mut returned = 0u64;
        let mut last_tag = None;
        while let Some(Some(Ok(d))) = self.consumer.next().now_or_never() {
            returned += 1;
            last_tag = Some(d.delivery_tag);
        }
        let Some(last_tag) = last_tag else { return };
        let nacked = bounded(
            "returning buffered deliveries",
            self.consume_ch.basic_nack(
                last_tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            ),
            SessionError::Ack,
        )
        .await;
        match nacked {
            Ok(()) => {
                self.events.returned(returned);
                tracing::info!(
                    worker = self.index,
                    returned,
                    "returned the deliveries buffered but not started to the queue"
                );
            }
            Err(e) => {
                tracing::debug!(worker = self.index, error = %ErrorChain(&e), "could not return buffered deliveries; the channel close returns them")
            }
        }
    }

    async fn consume_loop(&mut self, stop: &CancellationToken) -> Result<(), SessionError> {
        let batch_size = self.ctx.config.batch_size;
        let mut sweep = tokio::time::interval(crate::ordered::SWEEP_INTERVAL);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if let Some((pause, held)) = crate::pause::held_for(&self.ctx).await {
                if let ControlFlow::Break(()) = self.pause(pause, &held, stop).await? {
                    return Ok(());
                }
                continue;
            }
            let next = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(()),
                next = self.consumer.next() => next,
                _ = sweep.tick(), if self.slot.is_some() => {
                    self.sweep(stop).await?;
                    continue;
                }
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
            if let ControlFlow::Break(()) = self.end_probing(stop).await? {
                return Ok(());
            }
        }
    }

    /// Every handler's dependency holds calls back ([`crate::pause`]): stop consuming (the
    /// backlog stays in the queue), then look at the circuits again until one would let a call
    /// go, and consume again: one message at a time while that call is a probe, at the full
    /// prefetch if the circuit has closed meanwhile. Breaks on shutdown.
    async fn pause(
        &mut self,
        first: Duration,
        held: &str,
        stop: &CancellationToken,
    ) -> Result<ControlFlow<()>, SessionError> {
        tracing::info!(worker = self.index, dependencies = %held, "every handler's dependency holds calls back: taking no deliveries until one lets a call go");
        let _paused = Paused::start(self.events.clone(), held);
        let started = Instant::now();
        if let ControlFlow::Break(()) = self.stop_consuming(stop).await? {
            return Ok(ControlFlow::Break(()));
        }
        let mut pause = first;
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(ControlFlow::Break(())),
                _ = tokio::time::sleep(pause) => {}
            }
            match crate::pause::held_for(&self.ctx).await {
                Some((p, _)) => pause = p,
                None => break,
            }
        }
        self.probing = !crate::pause::all_let_through(&self.ctx);
        let prefetch = if self.probing {
            1
        } else {
            self.ctx.config.prefetch
        };
        self.consume(prefetch).await?;
        tracing::info!(worker = self.index, dependencies = %held, paused_s = started.elapsed().as_secs(), probing = self.probing, "taking deliveries again");
        Ok(ControlFlow::Continue(()))
    }

    /// After a probing consumer's batch: once the dependencies let calls go, consume at the full
    /// prefetch again (a channel's prefetch applies to the consumers started after it is set).
    async fn end_probing(
        &mut self,
        stop: &CancellationToken,
    ) -> Result<ControlFlow<()>, SessionError> {
        if !self.probing || !crate::pause::all_let_through(&self.ctx) {
            return Ok(ControlFlow::Continue(()));
        }
        if let ControlFlow::Break(()) = self.stop_consuming(stop).await? {
            return Ok(ControlFlow::Break(()));
        }
        self.probing = false;
        self.consume(self.ctx.config.prefetch).await?;
        Ok(ControlFlow::Continue(()))
    }

    /// Cancels the consumer (`basic.cancel`: the broker sends nothing more) and settles, as one
    /// batch, what it had already sent. Breaks if that batch was abandoned on shutdown.
    async fn stop_consuming(
        &mut self,
        stop: &CancellationToken,
    ) -> Result<ControlFlow<()>, SessionError> {
        let tag = self.consumer.tag();
        self.cancelled_by_us = true;
        bounded(
            "cancelling the consumer",
            self.consume_ch
                .basic_cancel(tag, BasicCancelOptions::default()),
            SessionError::Ack,
        )
        .await?;
        // After cancel-ok every delivery sent before it is buffered.
        let mut buffered = Vec::new();
        while let Some(Some(Ok(d))) = self.consumer.next().now_or_never() {
            buffered.push(d);
        }
        if !buffered.is_empty()
            && let BatchEnd::Abandoned = self.process_batch(buffered, Instant::now(), stop).await?
        {
            return Ok(ControlFlow::Break(()));
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Starts consuming the worker's queue again with `prefetch`.
    async fn consume(&mut self, prefetch: u16) -> Result<(), SessionError> {
        bounded(
            "setting the prefetch",
            self.consume_ch
                .basic_qos(prefetch, BasicQosOptions::default()),
            SessionError::Ack,
        )
        .await?;
        self.consumes += 1;
        let tag = format!("{}.{}", self.tag, self.consumes);
        self.consumer = bounded(
            "consuming again",
            self.consume_ch.basic_consume(
                self.queue.as_str().into(),
                tag.into(),
                BasicConsumeOptions::default(),
                self.consume_args.clone(),
            ),
            SessionError::Ack,
        )
        .await?;
        self.cancelled_by_us = false;
        Ok(())
    }

    /// With a fair share, a worker of the main queue sorts: each message it would handle goes
    /// to its key's lane instead ([`crate::fair`]); the lanes' own workers handle them.
    fn sort_into_lanes(&self, items: &mut [Item]) {
        let Some(share) = &self.ctx.fairness else {
            return;
        };
        if self.lane.is_some() || self.slot.is_some() {
            return;
        }
        for item in items.iter_mut() {
            if let Work::Handle(env, _) = &item.work {
                let key = share.key_of(env);
                item.work = Work::Lane(share.lane_of(&self.ctx.config.name, &key));
            }
        }
    }

    fn prepare(&self, delivery: Delivery) -> Item {
        let attempt = message::attempt(&delivery.properties);
        self.note_redelivery(&delivery, attempt);
        let routing_key = delivery.routing_key.as_str();
        let decoded = match screen::screen(&delivery.properties, routing_key) {
            Err(refusal) => {
                self.events.rejected(refusal.reason);
                Err(refusal.text)
            }
            Ok(()) => message::decode_screened(&delivery.properties, routing_key, &delivery.data),
        };
        let ordered = self.slot.is_some();
        let work = match decoded {
            Err(reason) => Work::Reject(DeadLetterKind::Undecodable, reason),
            Ok(env) if ordered && env.aggregate_seq.is_none_or(|s| s < 1) => Work::Reject(
                DeadLetterKind::Undecodable,
                "no aggregate_seq header (1 or more): an ordered consumer applies only numbered messages"
                    .into(),
            ),
            Ok(env) => match self.ctx.handlers.resolve(&env.event_type) {
                Some(h) => Work::Handle(Box::new(env), h.clone()),
                // Ordered: its turn still comes, it advances the position (strict is refused).
                None if ordered => Work::Advance(Box::new(env)),
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

    /// Counts a delivery the broker delivered before (its `redelivered` flag, or the quorum
    /// queue's `x-delivery-count`), and warns when that count reaches
    /// [`Config::redelivery_warning`](crate::Config::redelivery_warning): a message in a crash or
    /// stop loop nears the delivery limit, past which the broker dead-letters it unprocessed.
    fn note_redelivery(&self, delivery: &Delivery, attempt: u32) {
        let count = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(broker_headers::delivery_count)
            .unwrap_or(0);
        if !delivery.redelivered && count <= 0 {
            return;
        }
        self.events.redelivered();
        let threshold = i64::from(self.ctx.config.redelivery_warning);
        if threshold > 0 && count >= threshold {
            tracing::warn!(
                message_id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map_or("", |s| s.as_str()),
                delivery_count = count,
                warn_at = threshold,
                attempt,
                "message redelivered often: it nears the queue's delivery limit (x-delivery-count), past which the broker dead-letters it unprocessed"
            );
        }
    }

    async fn process_batch(
        &mut self,
        deliveries: Vec<Delivery>,
        started: Instant,
        stop: &CancellationToken,
    ) -> Result<BatchEnd, SessionError> {
        let size = deliveries.len();
        let mut items: Vec<Item> = deliveries.into_iter().map(|d| self.prepare(d)).collect();
        self.sort_into_lanes(&mut items);

        let mut fates: Vec<Option<Fate>> = vec![None; items.len()];
        if items
            .iter()
            .any(|i| matches!(i.work, Work::Handle(..) | Work::Advance(_)))
        {
            fates = match self.transact_until_decided(&items, stop).await? {
                ControlFlow::Continue(fates) => fates,
                ControlFlow::Break(end) => return Ok(end),
            };
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
        decide_unhandled(&items, &mut fates)?;
        let processed = fates
            .iter()
            .filter(|f| matches!(f, Some(Fate::Processed)))
            .count();
        self.events.messages(Outcome::Processed, processed as u64);

        if !self.ctx.config.ack_delay.is_zero() {
            tokio::time::sleep(self.ctx.config.ack_delay).await;
        }
        if let ControlFlow::Break(end) = self.publish_copies(&items, &mut fates, stop).await? {
            return Ok(end);
        }
        self.acknowledge(&items, &fates).await?;
        self.count_fates(&fates);
        self.events.batch(size, started.elapsed());
        Ok(BatchEnd::Settled)
    }

    /// Runs the batch's transaction until it commits (the fate of each message it handles),
    /// retrying after a database failure with backoff while the deliveries stay unacknowledged;
    /// breaks off (abandoning the batch to redelivery) on a stop while the database does not
    /// answer, and fails when the broker cancelled the consumer or closed the channel.
    async fn transact_until_decided(
        &mut self,
        items: &[Item],
        stop: &CancellationToken,
    ) -> Result<ControlFlow<BatchEnd, Vec<Option<Fate>>>, SessionError> {
        let size = items.len();
        let mut failures = 0u32;
        loop {
            let attempt = tokio::select! {
                biased;
                result = self.transact(items) => result?,
                () = cancelled_by_broker(&self.consumer, self.cancelled_by_us) => {
                    tracing::warn!(
                        worker = self.index,
                        batch = size,
                        "the broker cancelled the consumer during the batch's transaction (queue deleted, or the consumer timeout struck): leaving it to redelivery (rolled back, or deduplicated if its commit landed)"
                    );
                    return Err(SessionError::ConsumerCancelled);
                }
                () = stopped_without_database(stop, &self.ctx.readiness) => {
                    tracing::warn!(
                        worker = self.index,
                        batch = size,
                        "stopping while PostgreSQL does not answer the batch's transaction: leaving it to redelivery (rolled back, or deduplicated if its commit landed)"
                    );
                    return Ok(ControlFlow::Break(BatchEnd::Abandoned));
                }
            };
            let e = match attempt {
                Ok(fates) => {
                    self.ctx.readiness.set_postgres(true);
                    return Ok(ControlFlow::Continue(fates));
                }
                Err(e) => e,
            };
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
                    return Ok(ControlFlow::Break(BatchEnd::Abandoned));
                }
                () = cancelled_by_broker(&self.consumer, self.cancelled_by_us) => {
                    tracing::warn!(worker = self.index, batch = size, "the broker cancelled the consumer while the database was unavailable (queue deleted, or the consumer timeout struck): reconnecting; the batch is redelivered");
                    return Err(SessionError::ConsumerCancelled);
                }
                _ = tokio::time::sleep(delay) => {}
            }
            if !self.consume_ch.status().connected() {
                return Err(SessionError::ChannelClosed);
            }
            if self.consumer.is_cancelled() && !self.cancelled_by_us {
                return Err(SessionError::ConsumerCancelled);
            }
        }
    }

    /// One multi-ack up to the highest tag still ours: a delivery rejected because its copy
    /// could not fit a frame is settled already, and acking its tag again would make the broker
    /// close the channel (unknown delivery tag). Lower rejected tags are skipped by the broker.
    async fn acknowledge(
        &self,
        items: &[Item],
        fates: &[Option<Fate>],
    ) -> Result<(), SessionError> {
        let last_tag = items
            .iter()
            .zip(fates)
            .filter(|(_, f)| !matches!(f, Some(Fate::Discarded)))
            .map(|(i, _)| i.delivery.delivery_tag)
            .max();
        if let Some(last_tag) = last_tag {
            bounded(
                "acknowledging",
                self.consume_ch
                    .basic_ack(last_tag, BasicAckOptions { multiple: true }),
                SessionError::Ack,
            )
            .await?;
        }
        Ok(())
    }

    /// Counts the batch's settled messages by outcome (the processed ones were counted at once).
    fn count_fates(&self, fates: &[Option<Fate>]) {
        let mut counts = [0u64; Outcome::ALL.len()];
        for fate in fates.iter().flatten() {
            let outcome = match fate {
                Fate::Processed => continue,
                Fate::Duplicate => Outcome::Duplicate,
                Fate::Ignored => Outcome::Ignored,
                Fate::Retry(_) => Outcome::Retried,
                Fate::Wait(..) => Outcome::Waited,
                Fate::Lane(_) => Outcome::Sorted,
                Fate::Discarded => Outcome::Discarded,
                Fate::Held => Outcome::Held,
                Fate::Stale => Outcome::Stale,
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
    }

    /// The batch's transaction: ordered or not. `Err` ends the worker (fenced: the partition is
    /// not ours any more; its deliveries go back to the queue when the channel closes); `Ok(Err)`
    /// is a database failure, retried.
    async fn transact(
        &self,
        items: &[Item],
    ) -> Result<Result<Vec<Option<Fate>>, sqlx::Error>, SessionError> {
        let Some(slot) = self.slot else {
            return Ok(batch::transact(&self.ctx, &self.events, items).await);
        };
        match crate::ordered::apply::transact(&self.ctx, &self.events, slot, items, &[]).await {
            Ok(fates) => Ok(Ok(fates)),
            Err(ApplyError::Db(e)) => Ok(Err(e)),
            Err(ApplyError::Fenced(p)) => Err(SessionError::Fenced(p)),
        }
    }

    /// Ordered mode: applies held messages whose turn came (a retry's time, a gap filled by an
    /// operator's action), a bounded number of aggregates per turn.
    async fn sweep(&mut self, stop: &CancellationToken) -> Result<(), SessionError> {
        let Some(slot) = self.slot else { return Ok(()) };
        let cfg = &self.ctx.config;
        for _ in 0..10 {
            if stop.is_cancelled() {
                return Ok(());
            }
            let ready = async {
                let mut conn = self.ctx.pool.acquire().await?;
                crate::ordered::store::ready(&mut conn, &cfg.schema, &cfg.name, slot.partition, 100)
                    .await
            };
            let keys = match plumbing::db::bounded(ready).await {
                Ok(k) if k.is_empty() => return Ok(()),
                Ok(k) => k,
                Err(e) => {
                    tracing::debug!(error = %ErrorChain(&e), "ordered sweep: database unavailable");
                    return Ok(());
                }
            };
            match crate::ordered::apply::transact(&self.ctx, &self.events, slot, &[], &keys).await {
                Ok(_) => {}
                Err(ApplyError::Fenced(p)) => return Err(SessionError::Fenced(p)),
                Err(ApplyError::Db(e)) => {
                    tracing::warn!(error = %ErrorChain(&e), "ordered sweep failed; trying again at the next tick");
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Publishes the retry copies and dead letters of this batch and waits for the broker's
    /// confirms, so that the multi-ack that follows loses nothing. A copy that cannot be made to
    /// fit one frame (see [`copies::fit`]) is not published: its delivery is rejected without
    /// requeue, counted, and its fate becomes [`Fate::Discarded`].
    async fn publish_copies(
        &self,
        items: &[Item],
        fates: &mut [Option<Fate>],
        stop: &CancellationToken,
    ) -> Result<ControlFlow<BatchEnd>, SessionError> {
        let mut pending: Vec<(PublisherConfirm, String)> = Vec::new();
        for (item, fate) in items.iter().zip(fates.iter_mut()) {
            let Some(f) = fate.as_ref() else { continue };
            let d = &item.delivery;
            let copy = match copies::copy_of(&self.ctx, item, f, self.frame_max) {
                Ok(Some(copy)) => copy,
                Ok(None) => continue,
                Err(e) => {
                    let reason = e.to_string();
                    tracing::error!(
                        message_id = d.properties.message_id().as_ref().map_or("", |s| s.as_str()),
                        %reason,
                        "rejecting a delivery without requeue: its copy cannot be published"
                    );
                    bounded(
                        "rejecting",
                        self.consume_ch
                            .basic_reject(d.delivery_tag, BasicRejectOptions { requeue: false }),
                        SessionError::Ack,
                    )
                    .await?;
                    self.events.rejected(Reason::CopyTooLarge);
                    *fate = Some(Fate::Discarded);
                    continue;
                }
            };
            let confirm = self
                .publish_ch
                .basic_publish(
                    copy.exchange.as_str().into(),
                    copy.routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &d.data,
                    copy.properties,
                )
                .await
                .map_err(SessionError::Publish)?;
            pending.push((confirm, copy.what));
        }
        let mut deadline = tokio::time::Instant::now() + BROKER_TIMEOUT;
        for (confirm, what) in pending {
            let Some(confirmation) = self.copy_confirmed(confirm, &mut deadline, stop).await?
            else {
                return Ok(ControlFlow::Break(BatchEnd::Abandoned));
            };
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
        Ok(ControlFlow::Continue(()))
    }

    /// A copy's confirm, within `deadline`. While a resource alarm blocks the copies' connection
    /// there is no deadline: the broker confirms after the alarm, and this worker's batch waits
    /// unacknowledged while the other workers go on; the deadline counts again from the unblock.
    /// A stop meanwhile gives `None`: the batch is left to redelivery (its copies may go out twice;
    /// a retry is deduplicated by message id like any delivery).
    async fn copy_confirmed(
        &self,
        confirm: PublisherConfirm,
        deadline: &mut tokio::time::Instant,
        stop: &CancellationToken,
    ) -> Result<Option<lapin::Confirmation>, SessionError> {
        tokio::pin!(confirm);
        loop {
            let look_again = tokio::time::Instant::now() + Duration::from_millis(500);
            tokio::select! {
                r = &mut confirm => return r.map(Some).map_err(SessionError::Publish),
                () = tokio::time::sleep_until(look_again.min(*deadline)) => {}
            }
            if self.copies.blocked() {
                if stop.is_cancelled() {
                    tracing::info!(
                        worker = self.index,
                        "stopping while a resource alarm blocks this batch's copies: leaving it to redelivery"
                    );
                    return Ok(None);
                }
                *deadline = tokio::time::Instant::now() + BROKER_TIMEOUT;
            } else if tokio::time::Instant::now() >= *deadline {
                return Err(SessionError::Timeout("publisher confirm", BROKER_TIMEOUT));
            }
        }
    }
}

/// The fate of each message the transaction did not handle: dead-lettered (it cannot be
/// handled) or ignored. The transaction decides every handled message; were one left
/// undecided, nothing of the batch is acknowledged: the channel closes, all come back.
/// A worker counted as paused ([`Events::paused`]) until dropped, however the pause ends.
struct Paused {
    events: Events,
    held: String,
}

impl Paused {
    fn start(events: Events, held: &str) -> Self {
        events.paused(held, true);
        Self {
            events,
            held: held.to_string(),
        }
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        self.events.paused(&self.held, false);
    }
}

fn decide_unhandled(items: &[Item], fates: &mut [Option<Fate>]) -> Result<(), SessionError> {
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
                Work::Lane(queue) => Fate::Lane(queue.clone()),
                Work::Handle(..) | Work::Advance(_) => return Err(SessionError::Undecided),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_consumer_timeout_goes_only_to_brokers_that_take_it() {
        let config = Config::new("c", "amqp://x", "e");
        let v = |s| BrokerVersion::parse(s);
        let timeout = |broker| {
            consume_arguments(&config, broker)
                .inner()
                .get("x-consumer-timeout")
                .cloned()
        };
        assert_eq!(timeout(v("4.3.1")), Some(AMQPValue::LongLongInt(3_600_000)));
        assert_eq!(
            timeout(v("3.13.7")),
            Some(AMQPValue::LongLongInt(3_600_000))
        );
        assert_eq!(timeout(v("3.10.7")), None);
        assert_eq!(timeout(None), None);
        let mut off = config.clone();
        off.consumer_timeout = Duration::ZERO;
        assert!(consume_arguments(&off, v("4.3.1")).inner().is_empty());
    }
}
