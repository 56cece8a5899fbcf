//! RabbitMQ connections and the mapping between outbox JSON headers and AMQP headers.

use crate::amqp_tls::AmqpTls;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::{Connection, ConnectionProperties};
use serde_json::{Map, Number, Value};
use std::time::Duration;

/// Heartbeat interval added to AMQP URLs that do not set one: a dead link is noticed within
/// two intervals instead of the broker default of 60 s.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// Bytes of a content header frame besides the properties: frame type, channel and size (7),
/// class id, weight and body size (12), frame end (1). A message's properties must fit one frame
/// of the connection's `frame_max` less this.
pub const HEADER_FRAME_OVERHEAD: usize = 20;

/// The exact size of `properties` on the wire, measured with the protocol's own serializer
/// (`None` if it cannot be serialized).
pub fn properties_len(properties: &lapin::BasicProperties) -> Option<usize> {
    cookie_factory::gen_simple(
        lapin::protocol::basic::gen_properties(properties),
        Vec::new(),
    )
    .ok()
    .map(|buf| buf.len())
}

/// Errors from connecting to RabbitMQ.
#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    #[error("connecting to RabbitMQ timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("cannot connect to RabbitMQ")]
    Connect(#[source] lapin::Error),
    #[error("TLS settings for RabbitMQ")]
    Tls(#[from] crate::amqp_tls::AmqpTlsError),
    #[error("AMQP_URL names no RabbitMQ node")]
    NoNodes,
}

/// Adds `heartbeat=` (and a connection timeout) to the URL unless it already has them.
pub fn with_defaults(url: &str) -> String {
    let mut url = url.to_string();
    let mut sep = if url.contains('?') { '&' } else { '?' };
    if !url.contains("heartbeat=") {
        url.push(sep);
        url.push_str(&format!("heartbeat={DEFAULT_HEARTBEAT_SECS}"));
        sep = '&';
    }
    if !url.contains("connection_timeout=") {
        url.push(sep);
        url.push_str("connection_timeout=5000");
    }
    url
}

/// The smallest `frame_max` RabbitMQ accepts from 4.1 on (`connection.tune-ok` below it closes
/// the connection).
pub const MIN_FRAME_MAX: u32 = 8192;

/// A `frame_max` query parameter below [`MIN_FRAME_MAX`] in an AMQP URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "frame_max={frame_max} in the AMQP URL {url_hint} is below {MIN_FRAME_MAX}: RabbitMQ 4.1 and later refuse \
     the connection; remove the parameter (the broker's 128 KiB applies) or set it to {MIN_FRAME_MAX} or more"
)]
pub struct FrameMaxTooSmall {
    pub frame_max: u32,
    /// The URL's host part (no credentials), to say which node of a list.
    pub url_hint: String,
}

/// Refuses a `frame_max` below [`MIN_FRAME_MAX`] in any URL of `urls` (one URL or a comma-separated
/// list of a cluster's nodes). `0` ("no limit of the client's") and no parameter are fine; a URL
/// that does not parse is left for the connection to report.
pub fn check_frame_max(urls: &str) -> Result<(), FrameMaxTooSmall> {
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let Ok(uri) = url.parse::<lapin::uri::AMQPUri>() else {
            continue;
        };
        if let Some(frame_max) = uri.query.frame_max
            && frame_max != 0
            && frame_max < MIN_FRAME_MAX
        {
            return Err(FrameMaxTooSmall {
                frame_max,
                url_hint: format!("for {}:{}", uri.authority.host, uri.authority.port),
            });
        }
    }
    Ok(())
}

/// Connects with heartbeats on and a bounded wait; `name` shows in the management UI. An
/// `amqps://` URL verifies the broker's certificate against the system's roots and `tls.ca_file`.
pub async fn connect(url: &str, tls: &AmqpTls, name: &str) -> Result<Connection, AmqpError> {
    let timeout = Duration::from_secs(10);
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let tls = tls.load()?;
    let runtime = lapin::runtime::default_runtime().map_err(AmqpError::Connect)?;
    let url = with_defaults(url);
    let connecting = Connection::connect_with_config(&url, props, tls, runtime);
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(AmqpError::Connect(e)),
        Err(_) => Err(AmqpError::ConnectTimeout(timeout)),
    }
}

/// A header name that is not an AMQP short string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("header name of {0} bytes is longer than an AMQP short string (255 bytes)")]
pub struct HeaderNameTooLong(pub usize);

/// Converts a JSON object (the outbox `headers` column) into AMQP headers. Strings stay strings,
/// integers become 64-bit integers, booleans booleans, arrays field arrays; objects and anything
/// nested deeper than a few levels travel as their JSON text. A name longer than 255 bytes is an
/// error (and nothing is inserted for it); everything else converts.
pub fn json_to_headers(
    headers: &Map<String, Value>,
    table: &mut FieldTable,
) -> Result<(), HeaderNameTooLong> {
    for (k, v) in headers {
        let name = ShortString::try_new(k.as_str()).map_err(|_| HeaderNameTooLong(k.len()))?;
        table.insert(name, json_to_amqp(v, 0));
    }
    Ok(())
}

/// Arrays nested deeper than this travel as JSON text (no unbounded recursion on any input).
const MAX_ARRAY_DEPTH: usize = 8;

fn json_to_amqp(v: &Value, depth: usize) -> AMQPValue {
    match v {
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => match n.as_f64() {
                Some(f) => AMQPValue::Double(f),
                None => AMQPValue::LongString(LongString::from(n.to_string().as_str())),
            },
        },
        Value::Array(items) if depth < MAX_ARRAY_DEPTH => {
            let mut arr = FieldArray::default();
            for item in items {
                arr.push(json_to_amqp(item, depth + 1));
            }
            AMQPValue::FieldArray(arr)
        }
        other => AMQPValue::LongString(LongString::from(other.to_string().as_str())),
    }
}

/// Converts AMQP headers back into JSON (the consumer's [`shared::Envelope::headers`]).
pub fn headers_to_json(table: &FieldTable) -> Map<String, Value> {
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), amqp_to_json(v)))
        .collect()
}

fn amqp_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(i) => Value::from(*i),
        AMQPValue::ShortShortUInt(i) => Value::from(*i),
        AMQPValue::ShortInt(i) => Value::from(*i),
        AMQPValue::ShortUInt(i) => Value::from(*i),
        AMQPValue::LongInt(i) => Value::from(*i),
        AMQPValue::LongUInt(i) => Value::from(*i),
        AMQPValue::LongLongInt(i) => Value::from(*i),
        AMQPValue::Float(f) => Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number),
        AMQPValue::Double(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_string()),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(amqp_to_json).collect()),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::FieldTable(t) => Value::Object(headers_to_json(t)),
        other => Value::String(format!("{other:?}")),
    }
}

/// Reads a string header (long or short string).
pub fn header_str<'a>(table: &'a FieldTable, name: &str) -> Option<std::borrow::Cow<'a, str>> {
    match table.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => Some(std::borrow::Cow::Borrowed(s.as_str())),
        _ => None,
    }
}

/// Reads an integer header of any AMQP integer width (or a decimal string, as some clients
/// re-publish headers); `None` when absent or not an integer that fits an `i64`.
pub fn header_i64(table: &FieldTable, name: &str) -> Option<i64> {
    match table.inner().get(name)? {
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::Timestamp(v) => i64::try_from(*v).ok(),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_headers_of_any_width_are_read() {
        let mut t = FieldTable::default();
        t.insert("a".into(), AMQPValue::LongLongInt(7));
        t.insert("b".into(), AMQPValue::ShortShortUInt(3));
        t.insert("c".into(), AMQPValue::LongString("42".into()));
        t.insert("d".into(), AMQPValue::LongString("x".into()));
        t.insert("e".into(), AMQPValue::Boolean(true));
        assert_eq!(header_i64(&t, "a"), Some(7));
        assert_eq!(header_i64(&t, "b"), Some(3));
        assert_eq!(header_i64(&t, "c"), Some(42));
        assert_eq!(header_i64(&t, "d"), None);
        assert_eq!(header_i64(&t, "e"), None);
        assert_eq!(header_i64(&t, "missing"), None);
    }

    #[test]
    fn a_frame_max_below_8192_is_refused() {
        assert_eq!(
            check_frame_max("amqp://guest:guest@127.0.0.1:5672/%2f"),
            Ok(())
        );
        assert_eq!(
            check_frame_max("amqp://h/%2f?frame_max=8192&heartbeat=5"),
            Ok(())
        );
        assert_eq!(check_frame_max("amqp://h/%2f?frame_max=0"), Ok(()));
        let err = check_frame_max("amqp://a:5672/%2f,amqp://u:secret@b:5673/%2f?frame_max=4096")
            .unwrap_err();
        assert_eq!(err.frame_max, 4096);
        let text = err.to_string();
        assert!(text.contains("b:5673") && text.contains("8192"), "{text}");
        assert!(!text.contains("secret"), "{text}");
    }

    #[test]
    fn headers_round_trip() {
        let json: Map<String, Value> = serde_json::from_value(serde_json::json!({
            "traceparent": "00-abc-def-01", "retries": 3, "flag": true, "ratio": 0.5,
            "list": ["a", 1], "nested": {"x": 1}
        }))
        .unwrap();
        let mut table = FieldTable::default();
        json_to_headers(&json, &mut table).unwrap();
        let back = headers_to_json(&table);
        assert_eq!(back["traceparent"], "00-abc-def-01");
        assert_eq!(back["retries"], 3);
        assert_eq!(back["flag"], true);
        assert_eq!(back["ratio"], 0.5);
        assert_eq!(back["list"], serde_json::json!(["a", 1]));
        assert_eq!(back["nested"], "{\"x\":1}");
    }

    /// Cases per property test: few in the suite, more on demand (`PROPTEST_CASES=10000`).
    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(32)
    }

    fn json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            ".{0,40}".prop_map(Value::from),
        ];
        leaf.prop_recursive(16, 48, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(".{0,8}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(cases()))]

        /// Any JSON headers convert (or a name over 255 bytes is refused), never a panic; scalar
        /// strings, integers and booleans come back as they were; every name comes back.
        #[test]
        fn any_json_headers_map_and_scalars_round_trip(
            headers in proptest::collection::btree_map(".{0,100}", json(), 0..8),
        ) {
            let map: Map<String, Value> = headers.into_iter().collect();
            let mut table = FieldTable::default();
            match json_to_headers(&map, &mut table) {
                Err(HeaderNameTooLong(n)) => proptest::prop_assert!(n > 255),
                Ok(()) => {
                    let back = headers_to_json(&table);
                    proptest::prop_assert_eq!(back.len(), map.len());
                    for (k, v) in &map {
                        if matches!(v, Value::String(_) | Value::Bool(_))
                            || v.as_i64().is_some()
                        {
                            proptest::prop_assert_eq!(&back[k], v);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn heartbeat_is_added_once() {
        assert_eq!(
            with_defaults("amqp://h/%2f"),
            "amqp://h/%2f?heartbeat=10&connection_timeout=5000"
        );
        assert_eq!(
            with_defaults("amqp://h/%2f?heartbeat=5&connection_timeout=1"),
            "amqp://h/%2f?heartbeat=5&connection_timeout=1"
        );
    }
}

/// Header names the relay sets on every message (besides the row's own headers).
pub mod headers {
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    pub const AGGREGATE_ID: &str = "aggregate_id";
    /// The message's position within its aggregate (1, 2, 3, ... dense, in commit order), a signed
    /// 64-bit integer: a consumer detects a missing or out-of-order message from it alone.
    pub const AGGREGATE_SEQ: &str = "aggregate_seq";
    /// The outbox partition of the aggregate (0..63, a hash of `aggregate_id`), a signed 64-bit
    /// integer: an ordered consumer's headers exchange splits its traffic by it, so all of one
    /// aggregate's messages land in one of its partition queues.
    pub const AGGREGATE_PARTITION: &str = "aggregate_partition";
    /// RFC 3339 with microseconds: the outbox row's created_at (the AMQP timestamp has seconds only).
    pub const CREATED_AT: &str = "created_at";
}

/// Looks a queue up without creating it: a passive declare on a channel of its own, closed after.
/// Gives its message and consumer counts, or the broker's error (404 when it does not exist).
pub async fn inspect_queue(conn: &Connection, queue: &str) -> Result<lapin::Queue, lapin::Error> {
    let ch = conn.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let _ = ch.close(200, "inspected".into()).await;
    Ok(q)
}

/// Name of the alternate exchange and of the queue that keeps unroutable events of `exchange`.
pub fn unrouted_name(exchange: &str) -> String {
    format!("{exchange}.unrouted")
}

/// Declares the durable topic exchange events are published to. With `alternate` on, it also
/// declares `<exchange>.unrouted` (a fanout exchange and a durable queue bound to it) and makes it
/// the exchange's alternate exchange, so events no queue is bound for yet are kept, not dropped.
///
/// Consumers call this too (any side may start first). If the exchange already exists with other
/// arguments, RabbitMQ refuses the declaration; then the existing exchange is used as it is.
pub async fn declare_outbox_exchange(
    conn: &Connection,
    exchange: &str,
    alternate: bool,
) -> Result<(), lapin::Error> {
    use lapin::ExchangeKind;
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let mut ch = conn.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let mut args = FieldTable::default();
    if alternate {
        let ae = unrouted_name(exchange);
        ch.exchange_declare(
            ae.as_str().into(),
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await?;
        let queue = async {
            ch.queue_declare(
                ae.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
            ch.queue_bind(
                ae.as_str().into(),
                ae.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
        };
        if let Err(e) = queue.await {
            // A classic queue lives on one node; while that node of a cluster is down, declaring
            // it fails with NOT_FOUND. Publishing does not wait for it.
            if !matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404) {
                return Err(e);
            }
            tracing::warn!(queue = %ae, error = %e, "unrouted queue unavailable (its node is down); going on without it");
            ch = conn.create_channel().await?;
        }
        args.insert(
            "alternate-exchange".into(),
            AMQPValue::LongString(ae.as_str().into()),
        );
    }
    match ch
        .exchange_declare(exchange.into(), ExchangeKind::Topic, durable, args)
        .await
    {
        Ok(()) => {
            let _ = ch.close(200, "declared".into()).await;
            Ok(())
        }
        Err(e) => {
            // PRECONDITION_FAILED closes the channel: check on a new one that the exchange exists.
            tracing::warn!(%exchange, error = %e, "exchange exists with other arguments; using it as it is");
            let ch = conn.create_channel().await?;
            ch.exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
            let _ = ch.close(200, "declared".into()).await;
            Ok(())
        }
    }
}
