//! The PostgreSQL schema the product's objects live in (`outbox` by default).
//!
//! Everything the product creates (tables, indexes, functions, triggers, its migration history)
//! lives in one schema, so the product installs into a team's existing database without touching
//! its tables, and two independent installations can share a database. The name comes from
//! configuration (`--schema` / `OUTBOX_SCHEMA`), so it is validated and always quoted: SQL text
//! is written with a `{{schema}}` placeholder and [`Schema::sql`] puts the quoted name in.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// The default schema.
pub const DEFAULT: &str = "outbox";

/// A validated schema name: 1 to 63 bytes of lower-case ASCII letters, digits and `_`, not
/// starting with a digit or `pg_` (PostgreSQL reserves those).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Schema {
    name: Arc<str>,
    quoted: Arc<str>,
}

/// Why a schema name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid schema name {0:?}: use 1 to 63 lower-case letters, digits and '_', not starting with a digit or 'pg_'"
)]
pub struct InvalidSchema(pub String);

impl Schema {
    pub fn new(name: &str) -> Result<Self, InvalidSchema> {
        let valid = !name.is_empty()
            && name.len() <= 63
            && !name.starts_with("pg_")
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            return Err(InvalidSchema(name.to_string()));
        }
        Ok(Self {
            name: name.into(),
            quoted: format!("\"{name}\"").into(),
        })
    }

    /// The bare name (`outbox`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name as an SQL identifier (`"outbox"`).
    pub fn quoted(&self) -> &str {
        &self.quoted
    }

    /// `template` with every `{{schema}}` replaced by the quoted name.
    pub fn render(&self, template: &str) -> String {
        template.replace("{{schema}}", &self.quoted)
    }

    /// [`render`](Self::render), ready for `sqlx::query`: the only thing spliced in is the
    /// validated, quoted name.
    pub fn sql(&self, template: &str) -> sqlx::AssertSqlSafe<String> {
        sqlx::AssertSqlSafe(self.render(template))
    }

    /// The channel the outbox's insert trigger notifies (`<schema>.messages`).
    pub fn notify_channel(&self) -> String {
        format!("{}.messages", self.name)
    }
}

impl Default for Schema {
    fn default() -> Self {
        Self::new(DEFAULT).expect("the default schema name is valid")
    }
}

impl FromStr for Schema {
    type Err = InvalidSchema;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl fmt::Debug for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Schema({})", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names_and_quotes_them() {
        let s = Schema::new("billing_outbox2").unwrap();
        assert_eq!(s.quoted(), "\"billing_outbox2\"");
        assert_eq!(
            s.render("SELECT 1 FROM {{schema}}.messages"),
            "SELECT 1 FROM \"billing_outbox2\".messages"
        );
        assert_eq!(Schema::default().name(), "outbox");
    }

    #[test]
    fn refuses_anything_that_could_splice_sql() {
        for bad in [
            "",
            "Outbox",
            "out-box",
            "a\"; DROP TABLE x; --",
            "1abc",
            "pg_temp",
            "ünicode",
            &"a".repeat(64),
        ] {
            assert!(Schema::new(bad).is_err(), "{bad:?}");
        }
    }
}
