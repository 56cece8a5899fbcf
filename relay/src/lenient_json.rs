//! JSON a person reads from a row that may have broken the rules ([`LenientJson`]).

use serde_json::Value;

/// A `jsonb` column (selected as `::text`) parsed here, never failing: a document nested deeper
/// than serde_json's recursion limit (PostgreSQL stores it; nesting is one reason a row goes dead)
/// becomes a string that says why it is not shown, so one such row cannot fail a whole list. The
/// text itself is not shown either: it would bypass the console's key-based redaction.
pub(crate) struct LenientJson(Value);

impl sqlx::Type<sqlx::Postgres> for LenientJson {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <str as sqlx::Type<sqlx::Postgres>>::type_info()
    }
    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for LenientJson {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let text = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
        Ok(LenientJson(lenient(text)))
    }
}

fn lenient(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| {
        Value::String(format!(
            "(not shown: {} bytes of JSON serde cannot read: {e})",
            text.len()
        ))
    })
}

impl From<LenientJson> for Value {
    fn from(l: LenientJson) -> Value {
        l.0
    }
}

#[cfg(test)]
mod tests {
    use super::lenient;
    use serde_json::json;

    #[test]
    fn json_too_deep_to_read_is_named_not_failed() {
        assert_eq!(lenient(r#"{"a": 1}"#), json!({"a": 1}));
        let deep = format!("{}{}", "[".repeat(300), "]".repeat(300));
        let shown = lenient(&deep);
        assert!(
            shown
                .as_str()
                .is_some_and(|s| s.contains("600 bytes") && s.contains("recursion limit")),
            "{shown}"
        );
    }
}
