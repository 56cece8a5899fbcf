//! Strict validation at the boundary: the body must be `application/json`, parse as JSON without
//! duplicate field names, be an object with only known fields, and every field must have exactly the
//! accepted form. Violations are collected per field (`422 {"errors": [...]}`); unreadable bodies are
//! `400 {"error": ...}`, oversized ones 413, other media types 415. Nothing is reserved or stored
//! for a request that fails here.

use crate::error::{ApiError, FieldError};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode, header};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use uuid::Uuid;

/// Most lines in one order.
pub const MAX_ITEMS: usize = 100;
/// Longest `customer_id`.
pub const MAX_CUSTOMER_ID_LEN: usize = 255;
/// Longest `sku`.
pub const MAX_SKU_LEN: usize = 64;

/// A validated `POST /orders` body with its computed totals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewOrder {
    pub customer_id: String,
    pub currency: String,
    pub items: Vec<NewItem>,
    pub total_amount: i64,
}

/// A validated order line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewItem {
    pub sku: String,
    pub quantity: i64,
    pub unit_price: i64,
    pub line_total: i64,
}

impl NewOrder {
    /// The normalized request the fingerprint is taken over (amounts as integers).
    pub fn normalized(&self) -> Value {
        serde_json::json!({
            "customer_id": self.customer_id,
            "currency": self.currency,
            "items": self.items.iter().map(|i| serde_json::json!({
                "sku": i.sku,
                "quantity": i.quantity,
                "unit_price": i.unit_price,
            })).collect::<Vec<_>>(),
        })
    }
}

/// A validated `POST /payments` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPayment {
    pub order_id: Uuid,
    pub amount: i64,
    pub currency: String,
}

impl NewPayment {
    /// The normalized request the fingerprint is taken over (`"100"` and `100` are the same amount).
    pub fn normalized(&self) -> Value {
        serde_json::json!({
            "order_id": self.order_id.hyphenated().to_string(),
            "amount": self.amount,
            "currency": self.currency,
        })
    }
}

/// Reads the body of a JSON request: 413 over the limit, 415 for other media types, 400 for
/// anything that is not one JSON value without duplicate field names.
pub fn json_body(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge
        } else {
            tracing::debug!(%rejection, "cannot read request body");
            ApiError::BadRequest("cannot read request body".into())
        }
    })?;
    if !is_json(headers) {
        return Err(ApiError::UnsupportedMediaType);
    }
    parse_strict(&bytes)
}

/// Parses JSON, rejecting duplicate field names anywhere.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, ApiError> {
    match serde_json::from_slice::<StrictValue>(bytes) {
        Ok(StrictValue(v)) => Ok(v),
        Err(e) if e.is_data() => Err(ApiError::BadRequest(
            "request body contains a duplicate field name".into(),
        )),
        Err(e) => Err(ApiError::BadRequest(format!(
            "request body is not valid JSON (line {}, column {})",
            e.line(),
            e.column()
        ))),
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(content_type) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// A JSON value whose objects have no duplicate field names (serde_json keeps the last silently).
struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        StrictValue::deserialize(d).map(|s| s.0)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let StrictValue(value) = map.next_value()?;
            if object.insert(key, value).is_some() {
                return Err(de::Error::custom("duplicate field"));
            }
        }
        Ok(Value::Object(object))
    }
}

/// Field-by-field checks over one JSON object, collecting every problem.
struct Checker<'a> {
    errors: &'a mut Vec<FieldError>,
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

impl Checker<'_> {
    fn push(&mut self, field: String, code: &str, message: impl Into<String>) {
        self.errors.push(FieldError::new(field, code, message));
    }

    /// The object at `path`, with unknown fields reported.
    fn object<'v>(
        &mut self,
        value: &'v Value,
        path: &str,
        allowed: &[&str],
    ) -> Option<&'v Map<String, Value>> {
        let Value::Object(obj) = value else {
            let field = if path.is_empty() {
                "body".to_owned()
            } else {
                path.to_owned()
            };
            self.push(field, "invalid_type", "must be a JSON object");
            return None;
        };
        let mut unknown: Vec<&String> = obj
            .keys()
            .filter(|k| !allowed.contains(&k.as_str()))
            .collect();
        unknown.sort();
        for k in unknown {
            self.push(join(path, k), "unknown_field", "unknown field");
        }
        Some(obj)
    }

    /// A present, non-null field.
    fn required<'v>(
        &mut self,
        obj: &'v Map<String, Value>,
        path: &str,
        name: &str,
    ) -> Option<&'v Value> {
        match obj.get(name) {
            None | Some(Value::Null) => {
                self.push(join(path, name), "required", "is required");
                None
            }
            Some(v) => Some(v),
        }
    }

    /// Text of 1..=`max` characters, not blank, without control characters.
    fn text(&mut self, value: &Value, field: String, max: usize) -> Option<String> {
        let Value::String(s) = value else {
            self.push(field, "invalid_type", "must be a string");
            return None;
        };
        if s.trim().is_empty() {
            self.push(field, "invalid_value", "must not be empty");
            None
        } else if s.chars().count() > max {
            self.push(
                field,
                "too_long",
                format!("must be at most {max} characters"),
            );
            None
        } else if s.chars().any(char::is_control) {
            self.push(
                field,
                "invalid_value",
                "must not contain control characters",
            );
            None
        } else {
            Some(s.clone())
        }
    }

    fn currency(&mut self, value: &Value, field: String) -> Option<String> {
        match value {
            Value::String(s) if s.len() == 3 && s.bytes().all(|b| b.is_ascii_uppercase()) => {
                Some(s.clone())
            }
            Value::String(_) => {
                self.push(
                    field,
                    "invalid_value",
                    "must be three upper-case letters (ISO 4217), e.g. EUR",
                );
                None
            }
            _ => {
                self.push(
                    field,
                    "invalid_type",
                    "must be a string of three upper-case letters",
                );
                None
            }
        }
    }

    fn positive_int(&mut self, value: &Value, field: String) -> Option<i64> {
        match parse_positive_int(value) {
            Ok(v) => Some(v),
            Err((code, message)) => {
                self.push(field, code, message);
                None
            }
        }
    }

    fn uuid(&mut self, value: &Value, field: String) -> Option<Uuid> {
        let Value::String(s) = value else {
            self.push(field, "invalid_type", "must be a UUID string");
            return None;
        };
        match Uuid::try_parse(s) {
            Ok(id) if s.len() == 36 => Some(id),
            _ => {
                self.push(
                    field,
                    "invalid_value",
                    "must be a UUID (8-4-4-4-12 hex digits)",
                );
                None
            }
        }
    }
}

/// An integer amount or count: a JSON integer > 0, or a string of ASCII digits only (no sign, no
/// spaces, no exponent) with a value > 0; both within i64. Returns the code and message otherwise.
pub fn parse_positive_int(value: &Value) -> Result<i64, (&'static str, &'static str)> {
    const NOT_AN_INTEGER: &str =
        "must be a positive integer (a JSON integer or a string of digits)";
    match value {
        Value::Number(n) => match n.as_i64() {
            Some(v) if v > 0 => Ok(v),
            Some(_) => Err(("out_of_range", "must be greater than 0")),
            None if n.is_u64() => Err(("out_of_range", "is too large")),
            None => Err(("invalid_type", NOT_AN_INTEGER)),
        },
        Value::String(s) => {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(("invalid_value", NOT_AN_INTEGER));
            }
            match s.parse::<i64>() {
                Ok(v) if v > 0 => Ok(v),
                Ok(_) => Err(("out_of_range", "must be greater than 0")),
                Err(_) => Err(("out_of_range", "is too large")),
            }
        }
        _ => Err(("invalid_type", NOT_AN_INTEGER)),
    }
}

fn finish<T>(errors: Vec<FieldError>, value: Option<T>) -> Result<T, ApiError> {
    match value {
        Some(v) if errors.is_empty() => Ok(v),
        _ if errors.is_empty() => Err(ApiError::Internal(
            "validation produced no value and no error".into(),
        )),
        _ => Err(ApiError::Validation(errors)),
    }
}

/// Validates a `POST /orders` body and computes its totals with checked arithmetic.
pub fn order(body: &Value) -> Result<NewOrder, ApiError> {
    let mut errors = Vec::new();
    let mut c = Checker {
        errors: &mut errors,
    };
    let result = (|| {
        let obj = c.object(body, "", &["customer_id", "currency", "items"])?;
        let customer_id = c
            .required(obj, "", "customer_id")
            .and_then(|v| c.text(v, "customer_id".into(), MAX_CUSTOMER_ID_LEN));
        let currency = c
            .required(obj, "", "currency")
            .and_then(|v| c.currency(v, "currency".into()));
        let items = c.required(obj, "", "items").and_then(|v| items(&mut c, v));
        let (customer_id, currency, items) = (customer_id?, currency?, items?);
        let mut total: i64 = 0;
        for item in &items {
            match total.checked_add(item.line_total) {
                Some(t) => total = t,
                None => {
                    c.push(
                        "items".into(),
                        "overflow",
                        "order total exceeds the supported range",
                    );
                    return None;
                }
            }
        }
        Some(NewOrder {
            customer_id,
            currency,
            items,
            total_amount: total,
        })
    })();
    finish(errors, result)
}

fn items(c: &mut Checker<'_>, value: &Value) -> Option<Vec<NewItem>> {
    let Value::Array(list) = value else {
        c.push("items".into(), "invalid_type", "must be an array");
        return None;
    };
    if list.is_empty() {
        c.push(
            "items".into(),
            "invalid_value",
            "must hold at least one item",
        );
        return None;
    }
    if list.len() > MAX_ITEMS {
        c.push(
            "items".into(),
            "too_long",
            format!("must hold at most {MAX_ITEMS} items"),
        );
        return None;
    }
    let mut out = Vec::with_capacity(list.len());
    let mut ok = true;
    for (i, v) in list.iter().enumerate() {
        let path = format!("items[{i}]");
        let Some(obj) = c.object(v, &path, &["sku", "quantity", "unit_price"]) else {
            ok = false;
            continue;
        };
        let sku = c
            .required(obj, &path, "sku")
            .and_then(|v| c.text(v, join(&path, "sku"), MAX_SKU_LEN));
        let quantity = c
            .required(obj, &path, "quantity")
            .and_then(|v| c.positive_int(v, join(&path, "quantity")));
        let unit_price = c
            .required(obj, &path, "unit_price")
            .and_then(|v| c.positive_int(v, join(&path, "unit_price")));
        match (sku, quantity, unit_price) {
            (Some(sku), Some(quantity), Some(unit_price)) => match quantity.checked_mul(unit_price)
            {
                Some(line_total) => out.push(NewItem {
                    sku,
                    quantity,
                    unit_price,
                    line_total,
                }),
                None => {
                    c.push(
                        path,
                        "overflow",
                        "quantity * unit_price exceeds the supported range",
                    );
                    ok = false;
                }
            },
            _ => ok = false,
        }
    }
    ok.then_some(out)
}

/// Validates a `POST /payments` body.
pub fn payment(body: &Value) -> Result<NewPayment, ApiError> {
    let mut errors = Vec::new();
    let mut c = Checker {
        errors: &mut errors,
    };
    let result = (|| {
        let obj = c.object(body, "", &["order_id", "amount", "currency"])?;
        let order_id = c
            .required(obj, "", "order_id")
            .and_then(|v| c.uuid(v, "order_id".into()));
        let amount = c
            .required(obj, "", "amount")
            .and_then(|v| c.positive_int(v, "amount".into()));
        let currency = c
            .required(obj, "", "currency")
            .and_then(|v| c.currency(v, "currency".into()));
        Some(NewPayment {
            order_id: order_id?,
            amount: amount?,
            currency: currency?,
        })
    })();
    finish(errors, result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn amounts() {
        for ok in [
            json!(1),
            json!(100),
            json!("100"),
            json!("007"),
            json!(i64::MAX),
        ] {
            assert!(parse_positive_int(&ok).is_ok(), "{ok}");
        }
        let huge: Value = serde_json::from_str("9223372036854775808").unwrap();
        let huger: Value = serde_json::from_str("123456789012345678901234567890").unwrap();
        for bad in [
            json!("100; DROP TABLE payments"),
            json!(1.5),
            json!(-1),
            json!("1e3"),
            json!("  5"),
            json!("5 "),
            json!("-5"),
            json!("+5"),
            json!(0),
            json!("0"),
            json!(""),
            json!(true),
            json!(null),
            json!([1]),
            json!("9223372036854775808"),
            serde_json::from_str("1e3").unwrap(),
            serde_json::from_str("1.0").unwrap(),
            huge,
            huger,
        ] {
            assert!(parse_positive_int(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn duplicate_fields_are_rejected() {
        assert!(parse_strict(br#"{"amount": 1, "amount": 2}"#).is_err());
        assert!(parse_strict(br#"{"a": {"b": 1, "b": 1}}"#).is_err());
        assert!(parse_strict(br#"{"a": 1, "b": [1, 2.5, "x", null, {"c": true}]}"#).is_ok());
        assert!(parse_strict(b"{").is_err());
    }

    #[test]
    fn order_overflow_and_errors() {
        let body = json!({"customer_id": "c", "currency": "EUR",
            "items": [{"sku": "a", "quantity": i64::MAX, "unit_price": 2}]});
        let Err(ApiError::Validation(errors)) = order(&body) else {
            panic!("expected validation error")
        };
        assert_eq!(errors[0].code, "overflow");
        let body = json!({"customer_id": "c", "currency": "EUR",
            "items": [{"sku": "a", "quantity": i64::MAX, "unit_price": 1}, {"sku": "b", "quantity": 1, "unit_price": 1}]});
        let Err(ApiError::Validation(errors)) = order(&body) else {
            panic!("expected validation error")
        };
        assert_eq!(
            (errors[0].field.as_str(), errors[0].code.as_str()),
            ("items", "overflow")
        );
        let body = json!({"currency": "eur", "items": [], "x": 1});
        let Err(ApiError::Validation(errors)) = order(&body) else {
            panic!("expected validation error")
        };
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["x", "customer_id", "currency", "items"]);
        let ok = order(&json!({"customer_id": "c", "currency": "EUR",
            "items": [{"sku": "a", "quantity": 2, "unit_price": "150"}, {"sku": "b", "quantity": 1, "unit_price": 5}]}))
        .unwrap();
        assert_eq!(ok.total_amount, 305);
    }

    #[test]
    fn payment_rules() {
        let id = Uuid::now_v7();
        let p = payment(&json!({"order_id": id.to_string(), "amount": "100", "currency": "EUR"}))
            .unwrap();
        assert_eq!(
            p.normalized(),
            payment(&json!({"currency": "EUR", "amount": 100, "order_id": id.to_string()}))
                .unwrap()
                .normalized()
        );
        assert!(
            payment(&json!({"order_id": id.simple().to_string(), "amount": 1, "currency": "EUR"}))
                .is_err()
        );
        assert!(payment(&json!([1])).is_err());
    }
}
