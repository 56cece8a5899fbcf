//! Finding processes: one search ([`Query::search`]), filters, counts by status and keyset pages,
//! for operators (the console's process list, issue 23).
//!
//! A search is an exact match on any of the keys a person holds: the process id, the business
//! key, an operation id, a remote's reference (a charge id), or any top-level value of the
//! displayed input (an order or payment id in the demo's payment process). Each key is an index
//! lookup (migration `0017_console_find.sql`); a value that is no UUID never touches the UUID
//! columns. Only the redacted input is searched, so a sensitive value cannot be found by guessing.
//!
//! Pages are keyset pages over the process id, newest first (ids are UUIDv7, so id order is
//! creation order and never changes while a person pages): a page is `id < cursor ORDER BY id
//! DESC LIMIT n`, one index range however deep. Offsets are never used, so page 1,000 costs what
//! page 1 costs, and a process changing status while someone pages is neither skipped nor shown
//! twice. Every page says how many match in all ([`Page::total`]): a list is never cut silently.

use crate::admin::{PROCESS_COLUMNS, ProcessSummary};
use crate::definition::Remote;
use crate::error::{Error, ErrorClass};
use crate::status::ProcessStatus;
use serde::Serialize;
use shared::schema::Schema;
use sqlx::{FromRow, PgPool, Postgres, QueryBuilder, Row};
use std::time::Duration;
use uuid::Uuid;

/// The most a page holds.
pub const MAX_LIMIT: i64 = 500;
/// The most processes a filter may select for one bulk request (see [`matching`]).
pub const MAX_SELECTED: i64 = 1000;

/// What to find. Every part is optional; the parts that are set must all hold.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// An exact key: process id, business key, operation id, remote reference, input value.
    pub search: Option<String>,
    pub kind: Option<String>,
    pub status: Option<ProcessStatus>,
    pub paused: Option<bool>,
    /// A step with this name is open (running, retryable, failed or in manual review).
    pub step: Option<String>,
    /// An open step's last error was of this class (with [`Query::step`]: that step's).
    pub error_class: Option<ErrorClass>,
    /// An open step's remote has this capability (with [`Query::step`]: that step's).
    pub remote: Option<Remote>,
    /// In manual review for longer than this (since its last transition into it).
    pub in_review_longer_than: Option<Duration>,
    /// Created at least this many seconds ago.
    pub older_than_seconds: Option<i64>,
    /// The cursor: the last id of the previous page.
    pub after: Option<Uuid>,
    /// Page size, 1 to [`MAX_LIMIT`] (default 50).
    pub limit: Option<i64>,
}

/// One page of processes, newest first.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub items: Vec<ProcessSummary>,
    /// How many processes match the query in all (every page, not only this one).
    pub total: i64,
    /// The cursor of the next page; `None` on the last.
    pub next: Option<Uuid>,
    /// How many processes have each status, of all processes (the query aside).
    pub counts: Vec<(ProcessStatus, i64)>,
}

/// A process as a bulk request freezes it: its id and the version that was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Selected {
    pub id: Uuid,
    pub version: i64,
}

/// The oldest age a filter takes (a century): PostgreSQL's interval would overflow past it.
const MAX_AGE_SECONDS: i64 = 100 * 365 * 86_400;

impl Query {
    /// Whether anything but the cursor and the page size narrows the list.
    pub fn is_filtered(&self) -> bool {
        self.search.is_some()
            || self.kind.is_some()
            || self.paused.is_some()
            || self.step.is_some()
            || self.error_class.is_some()
            || self.remote.is_some()
            || self.in_review_longer_than.is_some()
            || self.older_than_seconds.is_some()
    }

    /// Appends ` WHERE ...` for every part that is set, except the cursor.
    fn push_where(&self, q: &mut QueryBuilder<Postgres>, schema: &Schema) {
        q.push(" WHERE true");
        if let Some(s) = self.search.clone() {
            push_search(q, schema, s);
        }
        if let Some(k) = self.kind.clone() {
            q.push(" AND p.kind = ").push_bind(k);
        }
        if let Some(s) = self.status {
            q.push(" AND p.status = ").push_bind(s.as_str());
        }
        if let Some(p) = self.paused {
            q.push(" AND p.paused = ").push_bind(p);
        }
        if self.step.is_some() || self.error_class.is_some() || self.remote.is_some() {
            q.push(schema.render(
                " AND EXISTS (SELECT 1 FROM {{schema}}.process_steps s WHERE s.process_id = p.id \
                 AND s.status IN ('running', 'retryable', 'failed', 'manual_review')",
            ));
            if let Some(n) = self.step.clone() {
                q.push(" AND s.name = ").push_bind(n);
            }
            if let Some(c) = self.error_class {
                q.push(" AND s.error_class = ").push_bind(c.as_str());
            }
            if let Some(r) = self.remote {
                q.push(" AND s.remote = ").push_bind(r.as_str());
            }
            q.push(")");
        }
        if let Some(d) = self.in_review_longer_than {
            let secs = i64::try_from(d.as_secs()).unwrap_or(MAX_AGE_SECONDS);
            q.push(schema.render(
                " AND p.status = 'manual_review' AND (SELECT max(h.at) FROM {{schema}}.process_history h \
                 WHERE h.process_id = p.id AND h.step_seq IS NULL AND h.to_status = 'manual_review') \
                 <= now() - make_interval(secs => ",
            ))
            .push_bind(secs.clamp(0, MAX_AGE_SECONDS))
            .push(")");
        }
        if let Some(o) = self.older_than_seconds {
            q.push(" AND p.created_at <= now() - make_interval(secs => ")
                .push_bind(o.clamp(0, MAX_AGE_SECONDS))
                .push(")");
        }
    }
}

/// The search as one `id IN (...)` of index lookups: the UUID keys only when `s` is a UUID.
fn push_search(q: &mut QueryBuilder<Postgres>, schema: &Schema, s: String) {
    q.push(" AND p.id IN (");
    if let Ok(u) = Uuid::parse_str(&s) {
        q.push("SELECT ").push_bind(u).push("::uuid UNION ");
        q.push(
            schema.render(
                "SELECT s.process_id FROM {{schema}}.process_steps s WHERE s.operation_id = ",
            ),
        )
        .push_bind(u)
        .push(" UNION ");
    }
    q.push(schema.render("SELECT b.id FROM {{schema}}.processes b WHERE b.business_key = "))
        .push_bind(s.clone());
    q.push(schema.render(
        " UNION SELECT r.process_id FROM {{schema}}.process_steps r WHERE r.remote_ref = ",
    ))
    .push_bind(s.clone());
    q.push(
        schema.render(" UNION SELECT i.id FROM {{schema}}.processes i WHERE i.input_redacted @? "),
    )
    .push_bind(input_value_path(&s))
    .push("::jsonpath)");
}

/// A JSON path matching an object any of whose top-level values is the string `s` (a JSON
/// string literal is a valid JSON path string literal).
fn input_value_path(s: &str) -> String {
    let literal = serde_json::Value::String(s.to_string()).to_string();
    format!("$.* ? (@ == {literal})")
}

/// One page of the processes matching `query`, and how many match in all.
pub async fn page(pool: &PgPool, schema: &Schema, query: &Query) -> Result<Page, Error> {
    let limit = query.limit.unwrap_or(50).clamp(1, MAX_LIMIT);
    let mut q = QueryBuilder::new(format!(
        "SELECT {} FROM {} p",
        PROCESS_COLUMNS
            .split(", ")
            .map(|c| format!("p.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", "),
        schema.render("{{schema}}.processes")
    ));
    query.push_where(&mut q, schema);
    if let Some(a) = query.after {
        q.push(" AND p.id < ").push_bind(a);
    }
    // One more than the page: whether there is a next page, without a second query.
    q.push(" ORDER BY p.id DESC LIMIT ").push_bind(limit + 1);
    let rows = q.build().fetch_all(pool).await?;
    let mut items = rows
        .iter()
        .map(ProcessSummary::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let more = items.len() as i64 > limit;
    items.truncate(limit as usize);
    let next = if more {
        items.last().map(|p| p.id)
    } else {
        None
    };
    let counts = counts(pool, schema).await?;
    let total = if query.is_filtered() {
        total(pool, schema, query).await?
    } else {
        // Unfiltered, or by status only: the counts say it, no second pass.
        counts
            .iter()
            .filter(|(s, _)| query.status.is_none_or(|want| *s == want))
            .map(|(_, n)| n)
            .sum()
    };
    Ok(Page {
        items,
        total,
        next,
        counts,
    })
}

/// How many processes match `query` (the cursor aside).
pub async fn total(pool: &PgPool, schema: &Schema, query: &Query) -> Result<i64, Error> {
    let mut q = QueryBuilder::new(format!(
        "SELECT count(*) FROM {} p",
        schema.render("{{schema}}.processes")
    ));
    query.push_where(&mut q, schema);
    Ok(q.build().fetch_one(pool).await?.try_get(0)?)
}

/// How many processes have each status (statuses with none are left out), in the order of
/// [`ProcessStatus`]'s declaration.
pub async fn counts(pool: &PgPool, schema: &Schema) -> Result<Vec<(ProcessStatus, i64)>, Error> {
    let rows = sqlx::query(
        schema.sql("SELECT status, count(*) AS n FROM {{schema}}.processes GROUP BY status"),
    )
    .fetch_all(pool)
    .await?;
    let mut out = rows
        .iter()
        .map(|r| Ok((r.try_get("status")?, r.try_get("n")?)))
        .collect::<Result<Vec<(ProcessStatus, i64)>, sqlx::Error>>()?;
    out.sort_by_key(|(s, _)| *s as u8);
    Ok(out)
}

/// Every process matching `query` (the cursor and page size aside), with its version, newest
/// first: what a bulk request freezes. More than [`MAX_SELECTED`] is [`Error::Invalid`]: a
/// request that large is narrowed first, never cut.
pub async fn matching(
    pool: &PgPool,
    schema: &Schema,
    query: &Query,
) -> Result<Vec<Selected>, Error> {
    let mut q = QueryBuilder::new(format!(
        "SELECT p.id, p.row_version FROM {} p",
        schema.render("{{schema}}.processes")
    ));
    query.push_where(&mut q, schema);
    q.push(" ORDER BY p.id DESC LIMIT ")
        .push_bind(MAX_SELECTED + 1);
    let rows = q.build().fetch_all(pool).await?;
    if rows.len() as i64 > MAX_SELECTED {
        return Err(Error::Invalid(format!(
            "more than {MAX_SELECTED} processes match: narrow the filter"
        )));
    }
    Ok(rows
        .iter()
        .map(|r| {
            Ok(Selected {
                id: r.try_get("id")?,
                version: r.try_get("row_version")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_value_path_quotes_what_it_is_given() {
        assert_eq!(input_value_path("o-1"), r#"$.* ? (@ == "o-1")"#);
        assert_eq!(input_value_path(r#"a"b\c"#), r#"$.* ? (@ == "a\"b\\c")"#);
    }
}
