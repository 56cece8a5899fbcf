//! [`WebhookEvent`]: a verified webhook body, read as the envelope Stripe and its imitators use:
//! `{"id": "evt_..", "type": "charge.succeeded", "created": <unix seconds>, "data": {"object":
//! {"id": "..", ...}}}`. Only `id` and `type` are required; the handler reads the rest from
//! [`WebhookEvent::payload`] (or [`WebhookEvent::object`]).

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Longest event id, object id and event type stored.
pub const MAX_ID_LEN: usize = 255;

/// The latest `created` accepted: 9999-12-31T23:59:59Z (PostgreSQL and chrono agree up to there).
const MAX_CREATED: i64 = 253_402_300_799;

/// A verified, parsed webhook event.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookEvent {
    /// The provider's event id: the inbox deduplicates by it.
    pub id: String,
    /// The event type (`charge.succeeded`).
    pub kind: String,
    /// The event's own time (`created`), if it has one.
    pub created: Option<DateTime<Utc>>,
    /// `data.object.id`, if any: the object the event is about.
    pub object_id: Option<String>,
    /// When the provider signed this delivery (the signature's `t`).
    pub signed_at: DateTime<Utc>,
    /// The whole body.
    pub payload: Value,
    /// The body as it was signed (UTF-8 JSON), stored as is.
    pub raw: String,
}

/// Why a verified body is no usable event: 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PayloadError(pub String);

impl WebhookEvent {
    /// Reads the envelope of `body` (already verified, signed at `signed_at`).
    pub fn parse(body: &[u8], signed_at: DateTime<Utc>) -> Result<Self, PayloadError> {
        let raw =
            std::str::from_utf8(body).map_err(|_| PayloadError("the body is not UTF-8".into()))?;
        let payload: Value = serde_json::from_str(raw)
            .map_err(|e| PayloadError(format!("the body is not JSON: {e}")))?;
        let id = text(&payload, "/id", "id")?
            .ok_or_else(|| PayloadError("the event has no string id".into()))?;
        let kind = text(&payload, "/type", "type")?
            .ok_or_else(|| PayloadError("the event has no string type".into()))?;
        let object_id = text(&payload, "/data/object/id", "data.object.id")?;
        let created = match payload.get("created") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_i64()
                    .filter(|s| (0..=MAX_CREATED).contains(s))
                    .and_then(|s| DateTime::from_timestamp(s, 0))
                    .ok_or_else(|| {
                        PayloadError("created must be Unix seconds (up to year 9999)".into())
                    })?,
            ),
        };
        Ok(Self {
            id,
            kind,
            created,
            object_id,
            signed_at,
            raw: raw.to_owned(),
            payload,
        })
    }

    /// `data.object` as `T` (the provider's object: a charge, a refund...).
    pub fn object<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(self.payload.pointer("/data/object").unwrap_or(&Value::Null))
    }
}

/// The string at `pointer`, if present: 1-255 bytes, no control characters (it is stored in
/// `text` columns and shown in logs). Present but not such a string: refused.
fn text(payload: &Value, pointer: &str, name: &str) -> Result<Option<String>, PayloadError> {
    match payload.pointer(pointer) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s))
            if !s.is_empty() && s.len() <= MAX_ID_LEN && !s.chars().any(char::is_control) =>
        {
            Ok(Some(s.clone()))
        }
        Some(_) => Err(PayloadError(format!(
            "{name} must be a string of 1-{MAX_ID_LEN} bytes without control characters"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    #[test]
    fn reads_the_envelope() {
        let body = br#"{"id":"evt_1","type":"charge.succeeded","created":1700000000,"data":{"object":{"id":"ch_1","amount":5}}}"#;
        let e = WebhookEvent::parse(body, t0()).unwrap();
        assert_eq!(e.id, "evt_1");
        assert_eq!(e.kind, "charge.succeeded");
        assert_eq!(e.created, Some(t0()));
        assert_eq!(e.object_id.as_deref(), Some("ch_1"));
        #[derive(serde::Deserialize)]
        struct Obj {
            amount: i64,
        }
        assert_eq!(e.object::<Obj>().unwrap().amount, 5);
    }

    #[test]
    fn refuses_what_it_cannot_store() {
        for bad in [
            &b"\xff"[..],
            b"not json",
            b"[]",
            br#"{"type":"x"}"#,
            br#"{"id":"","type":"x"}"#,
            br#"{"id":"a\u0000b","type":"x"}"#,
            br#"{"id":7,"type":"x"}"#,
            br#"{"id":"e","type":"x","created":"yesterday"}"#,
            br#"{"id":"e","type":"x","created":-8000000000000}"#,
            br#"{"id":"e","type":"x","data":{"object":{"id":["x"]}}}"#,
        ] {
            assert!(WebhookEvent::parse(bad, t0()).is_err(), "{bad:?}");
        }
        let long = format!(r#"{{"id":"{}","type":"x"}}"#, "e".repeat(256));
        assert!(WebhookEvent::parse(long.as_bytes(), t0()).is_err());
    }
}
