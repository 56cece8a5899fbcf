//! Publishing a claimed batch to RabbitMQ with publisher confirms.
//!
//! Up to `window` publishes are in flight at once, but never two of one aggregate: the next message
//! of an aggregate is sent only after the previous one was confirmed. So a nack or a return can never
//! let a later message of the same aggregate overtake an earlier one, and a partition with a failed
//! row sends nothing more in this batch.

use crate::internal_events::{self, FailureReason};
use crate::store::OutboxRow;
use futures::stream::{FuturesUnordered, StreamExt};
use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use shared::amqp::headers as h;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tracing::Instrument;

/// Errors setting up the broker side.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error(transparent)]
    Connect(#[from] shared::amqp::AmqpError),
    #[error("declaring the exchange or opening the confirm channel failed")]
    Setup(#[source] lapin::Error),
    #[error("declaring the exchange or opening the confirm channel timed out")]
    SetupTimeout,
}

/// The result of one batch.
#[derive(Debug, Default)]
pub struct BatchOutcome {
    /// Confirmed rows (seq, created_at).
    pub published: Vec<(i64, chrono::DateTime<chrono::Utc>)>,
    /// Rows the broker refused (nack or return): counted as an attempt.
    pub failed: Vec<(usize, FailureReason, String)>,
    /// Set when the link failed: every unconfirmed row stays pending, nothing is charged.
    pub link_error: Option<(FailureReason, String)>,
}

/// A broker connection with one confirm-mode channel.
pub struct Publisher {
    url: String,
    exchange: String,
    alternate_exchange: bool,
    window: usize,
    confirm_timeout: Duration,
    conn: Option<(Connection, Channel)>,
}

impl Publisher {
    pub fn new(
        url: &str,
        exchange: &str,
        alternate_exchange: bool,
        window: usize,
        confirm_timeout: Duration,
    ) -> Self {
        Self {
            url: url.to_string(),
            exchange: exchange.to_string(),
            alternate_exchange,
            window: window.max(1),
            confirm_timeout,
            conn: None,
        }
    }

    pub fn is_connected(&self) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|(c, ch)| c.status().connected() && ch.status().connected())
    }

    /// Connects, declares the exchange topology and opens a confirm channel, if not done yet.
    pub async fn ensure_connected(&mut self) -> Result<(), PublisherError> {
        if self.is_connected() {
            return Ok(());
        }
        self.disconnect().await;
        let conn = shared::amqp::connect(&self.url, "outbox-relay").await?;
        let setup = async {
            shared::amqp::declare_outbox_exchange(&conn, &self.exchange, self.alternate_exchange)
                .await?;
            let ch = conn.create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            Ok::<_, lapin::Error>(ch)
        };
        let ch = match tokio::time::timeout(Duration::from_secs(10), setup).await {
            Ok(Ok(ch)) => ch,
            Ok(Err(e)) => return Err(PublisherError::Setup(e)),
            Err(_) => return Err(PublisherError::SetupTimeout),
        };
        tracing::info!(exchange = %self.exchange, "connected to RabbitMQ");
        self.conn = Some((conn, ch));
        Ok(())
    }

    /// Closes the connection (bounded); the next batch reconnects.
    pub async fn disconnect(&mut self) {
        if let Some((conn, _)) = self.conn.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                conn.close(200, "relay closing".into()),
            )
            .await;
        }
    }

    /// Depth of the unrouted queue, when the alternate exchange is on.
    pub async fn unrouted_depth(&self) -> Option<u32> {
        if !self.alternate_exchange {
            return None;
        }
        let (conn, _) = self.conn.as_ref()?;
        let name = shared::amqp::unrouted_name(&self.exchange);
        let fut = async {
            let ch = conn.create_channel().await.ok()?;
            let q = ch
                .queue_declare(
                    name.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .ok()?;
            let _ = ch.close(200, "ok".into()).await;
            Some(q.message_count())
        };
        tokio::time::timeout(Duration::from_secs(2), fut)
            .await
            .ok()
            .flatten()
    }

    /// Publishes `rows` (sorted by seq) and waits for their confirms (each bounded by the confirm timeout).
    pub async fn publish_batch(
        &mut self,
        rows: &[OutboxRow],
        send_until: tokio::time::Instant,
    ) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        let Some((_, channel)) = self.conn.as_ref() else {
            outcome.link_error = Some((FailureReason::Connection, "not connected".into()));
            return outcome;
        };
        let channel = channel.clone();

        // next[i]: the following row of the same aggregate in this batch.
        let mut next: Vec<Option<usize>> = vec![None; rows.len()];
        let mut last: HashMap<&str, usize> = HashMap::with_capacity(rows.len());
        let mut ready: std::collections::VecDeque<usize> = std::collections::VecDeque::new();
        for (i, row) in rows.iter().enumerate() {
            match last.insert(row.aggregate_id.as_str(), i) {
                Some(prev) => next[prev] = Some(i),
                None => ready.push_back(i),
            }
        }

        let mut failed_partitions: HashSet<i16> = HashSet::new();
        let mut in_flight = FuturesUnordered::new();
        let timeout = self.confirm_timeout;
        let mut sent = 0usize;
        loop {
            // Past `send_until` the partition leases may not outlive the confirms: send no more.
            while outcome.link_error.is_none()
                && in_flight.len() < self.window
                && tokio::time::Instant::now() < send_until
            {
                let Some(i) = ready.pop_front() else { break };
                let row = &rows[i];
                if failed_partitions.contains(&row.partition) {
                    continue; // its successors stay unsent too
                }
                let traceparent = row.headers.get("traceparent").and_then(|v| v.as_str());
                let span = tracing::info_span!(
                    "publish",
                    message_id = %row.id,
                    trace_id = shared::trace::trace_id(traceparent).unwrap_or(""),
                    seq = row.seq
                );
                if let Some(tp) = traceparent {
                    shared::trace::set_parent(&span, tp);
                }
                match self.send(&channel, row).instrument(span).await {
                    Ok(confirm) => {
                        sent += 1;
                        in_flight
                            .push(async move { (i, tokio::time::timeout(timeout, confirm).await) })
                    }
                    Err(e) => outcome.link_error = Some((FailureReason::Connection, e.to_string())),
                }
            }
            let Some((i, result)) = in_flight.next().await else {
                break;
            };
            let row = &rows[i];
            match result {
                Ok(Ok(Confirmation::Ack(None))) => {
                    outcome.published.push((row.seq, row.created_at));
                    if let Some(n) = next[i] {
                        ready.push_back(n);
                    }
                }
                Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                    let why = format!(
                        "unroutable: {} {}",
                        returned.reply_code,
                        returned.reply_text.as_str()
                    );
                    failed_partitions.insert(row.partition);
                    outcome.failed.push((i, FailureReason::Unroutable, why));
                }
                Ok(Ok(Confirmation::Nack(_))) => {
                    failed_partitions.insert(row.partition);
                    outcome
                        .failed
                        .push((i, FailureReason::Nack, "nacked by broker".into()));
                }
                Ok(Ok(Confirmation::NotRequested)) => {
                    outcome.link_error = Some((
                        FailureReason::Connection,
                        "channel not in confirm mode".into(),
                    ));
                }
                Ok(Err(e)) => {
                    outcome
                        .link_error
                        .get_or_insert((FailureReason::Connection, e.to_string()));
                }
                Err(_) => {
                    outcome.link_error.get_or_insert((
                        FailureReason::ConfirmTimeout,
                        format!("no confirm within {timeout:?}"),
                    ));
                    // A confirm that is late for one is late for all behind it: stop waiting.
                    break;
                }
            }
            if outcome.link_error.is_some() && in_flight.is_empty() {
                break;
            }
        }
        for (_, reason, _) in &outcome.failed {
            internal_events::publish_failed(*reason, 1);
        }
        if let Some((reason, error)) = &outcome.link_error {
            let unconfirmed = sent - outcome.published.len() - outcome.failed.len();
            internal_events::publish_failed(*reason, unconfirmed);
            tracing::warn!(%error, unconfirmed, "broker link failed during a batch; unconfirmed rows stay pending");
            self.disconnect().await;
        }
        outcome
    }

    async fn send(
        &self,
        channel: &Channel,
        row: &OutboxRow,
    ) -> Result<lapin::PublisherConfirm, lapin::Error> {
        let mut headers = FieldTable::default();
        shared::amqp::json_to_headers(&row.headers, &mut headers);
        headers.insert(
            h::AGGREGATE_TYPE.into(),
            AMQPValue::LongString(LongString::from(row.aggregate_type.as_str())),
        );
        headers.insert(
            h::AGGREGATE_ID.into(),
            AMQPValue::LongString(LongString::from(row.aggregate_id.as_str())),
        );
        let created = row
            .created_at
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        headers.insert(
            h::CREATED_AT.into(),
            AMQPValue::LongString(LongString::from(created.as_str())),
        );
        let props = BasicProperties::default()
            .with_message_id(ShortString::from(row.id.to_string()))
            .with_type(ShortString::from(row.event_type.as_str()))
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_timestamp(row.created_at.timestamp().max(0) as u64)
            .with_headers(headers);
        channel
            .basic_publish(
                self.exchange.as_str().into(),
                row.event_type.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                row.payload.as_bytes(),
                props,
            )
            .await
    }
}
