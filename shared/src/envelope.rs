//! The message, from the producer's and the consumer's side.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

/// An event a producer adds to the outbox in its own transaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewMessage {
    /// Message id; consumers deduplicate on it. [`NewMessage::new`] sets a UUIDv7 (time ordered, so the
    /// unique index on it stays compact).
    pub id: Uuid,
    /// Kind of entity the event is about, e.g. `order`.
    pub aggregate_type: String,
    /// Entity id; events of one aggregate id are published in order.
    pub aggregate_id: String,
    /// Event name and AMQP routing key, e.g. `order.placed`.
    pub event_type: String,
    /// The event body.
    pub payload: Value,
    /// Extra AMQP headers (traceparent, correlation id, tenant...).
    pub headers: Map<String, Value>,
}

impl NewMessage {
    /// A message with a fresh UUIDv7 id and no extra headers.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Value,
    ) -> Self {
        Self {
            id: Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: Map::new(),
        }
    }

    /// Adds one header (for example `traceparent`).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Checks the message against the publishability rules ([`crate::publishable`]); `enqueue`
    /// does it too.
    pub fn check(&self) -> Result<(), crate::publishable::MessageError> {
        crate::publishable::check(
            &self.aggregate_type,
            &self.aggregate_id,
            &self.event_type,
            &self.headers,
        )
    }

    /// Serializes a typed payload.
    pub fn from_serde<T: Serialize>(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self::new(
            aggregate_type,
            aggregate_id,
            event_type,
            serde_json::to_value(payload)?,
        ))
    }
}

/// A message as a consumer receives it: the AMQP properties and headers the relay sets, decoded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// AMQP `message_id`: the outbox row's id.
    pub message_id: Uuid,
    /// AMQP `type` (and routing key): the outbox row's event_type.
    pub event_type: String,
    /// Header `aggregate_type`.
    pub aggregate_type: String,
    /// Header `aggregate_id`.
    pub aggregate_id: String,
    /// Header `aggregate_seq`: the message's position within its aggregate (1, 2, 3, ... in commit
    /// order, no gaps). `None` for a message published before the relay set it.
    #[serde(default)]
    pub aggregate_seq: Option<i64>,
    /// When the producer inserted the row (header `created_at`, microsecond precision).
    pub created_at: Option<DateTime<Utc>>,
    /// All other headers, as JSON.
    pub headers: Map<String, Value>,
    /// The body, parsed as JSON.
    pub payload: Value,
}

impl Envelope {
    /// Deserializes the payload into a typed event.
    pub fn payload_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.payload)
    }

    /// The W3C `traceparent` header, if the producer set one.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get("traceparent").and_then(Value::as_str)
    }
}
