//! The broker side: one connection with one confirm-mode channel, the exchange topology, and the
//! sending of encoded rows ([`crate::encoder`]). What is sent when is decided by `crate::pipeline`.
//!
//! A channel the broker closed over one message (406 on a body over `max_message_size`) is
//! replaced on the same connection: one row's refusal never costs the connection.

use crate::encoder::Encoded;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{Channel, Connection};
use plumbing::amqp_tls::AmqpTls;
use std::time::Duration;

/// Errors setting up the broker side.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error(transparent)]
    Connect(#[from] plumbing::amqp::AmqpError),
    #[error("declaring the exchange or opening the confirm channel failed")]
    Setup(#[source] lapin::Error),
    #[error("declaring the exchange or opening the confirm channel timed out")]
    SetupTimeout,
}

/// A broker connection with one confirm-mode channel.
pub struct Publisher {
    url: String,
    tls: AmqpTls,
    exchange: String,
    alternate_exchange: bool,
    conn: Option<Connection>,
    channel: Option<Channel>,
}

impl Publisher {
    pub fn new(url: &str, exchange: &str, alternate_exchange: bool) -> Self {
        Self {
            url: url.to_string(),
            tls: AmqpTls::default(),
            exchange: exchange.to_string(),
            alternate_exchange,
            conn: None,
            channel: None,
        }
    }

    /// Uses these certificate files for an `amqps://` URL.
    pub fn with_tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    pub fn is_connected(&self) -> bool {
        self.connection_alive()
            && self
                .channel
                .as_ref()
                .is_some_and(|ch| ch.status().connected())
    }

    fn connection_alive(&self) -> bool {
        self.live_connection().is_some()
    }

    fn live_connection(&self) -> Option<&Connection> {
        self.conn.as_ref().filter(|c| c.status().connected())
    }

    /// Whether RabbitMQ has blocked the connection (`connection.blocked`: a memory or disk alarm).
    /// lapin writes nothing while it is; publishes and their confirms wait for the unblock.
    pub fn is_blocked(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.status().blocked())
    }

    /// The connection's status, for confirm waits that must not time out while it is blocked.
    pub fn status(&self) -> Option<lapin::ConnectionStatus> {
        self.conn.as_ref().map(|c| c.status().clone())
    }

    /// Connects, declares the exchange topology and opens a confirm channel, if not done yet.
    pub async fn ensure_connected(&mut self) -> Result<(), PublisherError> {
        if self.is_connected() {
            return Ok(());
        }
        if let Some(conn) = self.live_connection() {
            // Only the channel is gone: a new one on the same connection.
            match tokio::time::timeout(Duration::from_secs(10), confirm_channel(conn)).await {
                Ok(Ok(ch)) => {
                    crate::internal_events::amqp_opened("channel");
                    tracing::info!("opened a new confirm channel on the same connection");
                    self.channel = Some(ch);
                    return Ok(());
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "no new channel on the connection; reconnecting")
                }
                Err(_) => tracing::debug!("opening a channel timed out; reconnecting"),
            }
        }
        self.disconnect().await;
        let conn = plumbing::amqp_nodes::connect(&self.url, &self.tls, "outbox-relay").await?;
        let setup = async {
            plumbing::amqp::declare_outbox_exchange(&conn, &self.exchange, self.alternate_exchange)
                .await?;
            confirm_channel(&conn).await
        };
        let ch = match tokio::time::timeout(Duration::from_secs(10), setup).await {
            Ok(Ok(ch)) => ch,
            Ok(Err(e)) => return Err(PublisherError::Setup(e)),
            Err(_) => return Err(PublisherError::SetupTimeout),
        };
        crate::internal_events::amqp_opened("connection");
        crate::internal_events::amqp_opened("channel");
        tracing::info!(exchange = %self.exchange, "connected to RabbitMQ");
        self.conn = Some(conn);
        self.channel = Some(ch);
        Ok(())
    }

    /// Closes the channel only (bounded); the next batch opens a new one on the same connection.
    pub async fn drop_channel(&mut self) {
        if let Some(ch) = self.channel.take() {
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                ch.close(200, "relay closing".into()),
            )
            .await;
        }
    }

    /// Closes the channel, then the connection, both within 2 s (a black-holed broker answers
    /// neither); the next batch reconnects. The channel first: closing the connection under a
    /// channel that is still closing makes lapin log an error for what is an orderly stop.
    pub async fn disconnect(&mut self) {
        let (channel, conn) = (self.channel.take(), self.conn.take());
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            if let Some(ch) = channel {
                let _ = ch.close(200, "relay closing".into()).await;
            }
            if let Some(conn) = conn {
                let _ = conn.close(200, "relay closing".into()).await;
            }
        })
        .await;
    }

    /// The connection's negotiated `frame_max` (properties and headers of one message must fit a
    /// frame), once connected.
    pub fn frame_max(&self) -> Option<u32> {
        self.conn.as_ref().map(|c| c.configuration().frame_max())
    }

    /// What sending needs, detached from the publisher, while a confirm channel is open: a batch
    /// of publishes can then be in flight while the pipeline goes on (a blocked connection holds
    /// every publish until the broker unblocks it).
    pub fn sender(&self) -> Option<Sender> {
        self.channel.as_ref().map(|channel| Sender {
            channel: channel.clone(),
            exchange: self.exchange.as_str().into(),
        })
    }

    /// Sends one encoded row on the current channel; see [`Sender::send`].
    pub async fn send(
        &self,
        message: Encoded,
        payload: &[u8],
    ) -> Result<lapin::PublisherConfirm, lapin::Error> {
        match self.sender() {
            Some(sender) => sender.send(message, payload).await,
            None => Err(closed()),
        }
    }
}

/// The error of a send with no channel open.
pub fn closed() -> lapin::Error {
    lapin::Error::from(lapin::ErrorKind::InvalidConnectionState(
        lapin::ConnectionState::Closed,
    ))
}

/// One confirm channel and the exchange, owned, so sends can outlive a borrow of the publisher.
#[derive(Clone)]
pub struct Sender {
    channel: Channel,
    exchange: ShortString,
}

impl Sender {
    /// Sends one encoded row (persistent, mandatory) and returns the future of its confirm.
    /// Completes once lapin has written the frames: never while the broker blocks the connection.
    /// Takes the encoded message by value: lapin takes the properties by value, and a clone of
    /// their header table was a dozen allocations per publish.
    pub async fn send(
        &self,
        message: Encoded,
        payload: &[u8],
    ) -> Result<lapin::PublisherConfirm, lapin::Error> {
        self.channel
            .basic_publish(
                self.exchange.clone(),
                message.routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                payload,
                message.properties,
            )
            .await
    }
}

/// A channel in confirm mode.
async fn confirm_channel(conn: &Connection) -> Result<Channel, lapin::Error> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(ch)
}

/// Depth of `<exchange>.unrouted` (bounded to 2 s).
pub async fn unrouted_depth(conn: &Connection, exchange: &str) -> Option<u32> {
    let name = plumbing::amqp::unrouted_name(exchange);
    tokio::time::timeout(
        Duration::from_secs(2),
        plumbing::amqp::inspect_queue(conn, &name),
    )
    .await
    .ok()?
    .ok()
    .map(|q| q.message_count())
}
