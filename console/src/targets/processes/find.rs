//! Finding processes: the console's one search box, its filters, counts by status and keyset
//! pages, on the processes crate's `find` module. What a client sends is text; it is checked here
//! (after the role check, so a refused caller is audited whatever they sent) and a value that is
//! no filter is a 400 naming it, never an empty list.

use super::view::summary;
use super::{Admin, error};
use crate::error::ConsoleError;
use crate::targets::cursor;
use processes::find::{self, Query, Selected};
use processes::{ErrorClass, ProcessStatus, Remote};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;
use utoipa::IntoParams;

/// The query of `GET /api/processes` and of the process list page: a search, filters and a
/// cursor. Every part is optional; the ones given must all hold.
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
pub struct ProcessQuery {
    /// Exact key: a process id, business key, order or payment id (any top-level input value),
    /// operation id or remote reference (a charge id).
    pub q: Option<String>,
    pub kind: Option<String>,
    /// A process status (`manual_review`, `failed`, ...).
    pub status: Option<String>,
    /// `true` or `false`.
    pub paused: Option<String>,
    /// An open step (running, retryable, failed, manual review) of this name.
    pub step: Option<String>,
    /// An open step's last error class: `transient`, `permanent` or `unknown`.
    pub error_class: Option<String>,
    /// An open step's remote: `honours_key`, `queryable` or `none`.
    pub remote: Option<String>,
    /// In manual review longer than this: `1h`, `30m`, `2days` (humantime).
    pub in_review_longer_than: Option<String>,
    /// Only processes created at least this many seconds ago.
    pub older_than_seconds: Option<i64>,
    /// The `next` of the previous page.
    pub after: Option<String>,
    /// Page size, 1 to 500 (default 50).
    pub limit: Option<i64>,
}

/// Text given and not blank.
fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// A value that is none of `what`'s words: a 400 naming the field and the words.
fn refuse(field: &str, value: &str, words: &str) -> ConsoleError {
    ConsoleError::BadRequest(format!("{field}: {value:?} is not one of {words}"))
}

impl ProcessQuery {
    /// The query as the processes crate takes it; any text that is no filter is a 400.
    pub fn check(&self) -> Result<Query, ConsoleError> {
        crate::text::check_all([
            ("q", self.q.as_deref()),
            ("kind", self.kind.as_deref()),
            ("status", self.status.as_deref()),
            ("paused", self.paused.as_deref()),
            ("step", self.step.as_deref()),
            ("error_class", self.error_class.as_deref()),
            ("remote", self.remote.as_deref()),
            (
                "in_review_longer_than",
                self.in_review_longer_than.as_deref(),
            ),
            ("after", self.after.as_deref()),
        ])?;
        for (field, v) in [("q", &self.q), ("kind", &self.kind), ("step", &self.step)] {
            if given(v).is_some_and(|v| v.len() > 500) {
                return Err(ConsoleError::BadRequest(format!(
                    "{field}: at most 500 bytes"
                )));
            }
        }
        Ok(Query {
            search: given(&self.q).map(str::to_string),
            kind: given(&self.kind).map(str::to_string),
            status: self.status()?,
            paused: match given(&self.paused) {
                None => None,
                Some("true") => Some(true),
                Some("false") => Some(false),
                Some(v) => return Err(refuse("paused", v, "true, false")),
            },
            step: given(&self.step).map(str::to_string),
            error_class: match given(&self.error_class) {
                None => None,
                Some(v) => Some(
                    ErrorClass::parse(v)
                        .ok_or_else(|| refuse("error_class", v, "transient, permanent, unknown"))?,
                ),
            },
            remote: match given(&self.remote) {
                None => None,
                Some(v) => Some(
                    Remote::parse(v)
                        .ok_or_else(|| refuse("remote", v, "honours_key, queryable, none"))?,
                ),
            },
            in_review_longer_than: match given(&self.in_review_longer_than) {
                None => None,
                Some(v) => Some(humantime::parse_duration(v).map_err(|e| {
                    ConsoleError::BadRequest(format!(
                        "in_review_longer_than: {v:?} is no duration (1h, 30m, 2days): {e}"
                    ))
                })?),
            },
            older_than_seconds: self.older_than_seconds,
            after: given(&self.after).map(cursor::process).transpose()?,
            limit: self.limit,
        })
    }

    /// The filters given, as a query string (`status=manual_review&step=charge`), with `step` if
    /// given: how an audit entry and an approval request name what a bulk request selected.
    pub fn describe(&self, step: Option<&str>) -> String {
        let older = self.older_than_seconds.map(|o| o.to_string());
        [
            ("q", self.q.as_deref()),
            ("kind", self.kind.as_deref()),
            ("status", self.status.as_deref()),
            ("paused", self.paused.as_deref()),
            ("step", self.step.as_deref().or(step)),
            ("error_class", self.error_class.as_deref()),
            ("remote", self.remote.as_deref()),
            (
                "in_review_longer_than",
                self.in_review_longer_than.as_deref(),
            ),
            ("older_than_seconds", older.as_deref()),
        ]
        .iter()
        .filter_map(|(k, v)| v.map(str::trim).filter(|v| !v.is_empty()).map(|v| (k, v)))
        .map(|(k, v)| format!("{k}={}", crate::text::url_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
    }

    fn status(&self) -> Result<Option<ProcessStatus>, ConsoleError> {
        match given(&self.status) {
            None => Ok(None),
            Some(s) => ProcessStatus::parse(s).map(Some).ok_or_else(|| {
                ConsoleError::BadRequest(format!("status: no process status is called {s:?}"))
            }),
        }
    }
}

/// How many processes have each status, as the console shows them (`{"status", "count"}`).
fn counts_json(counts: &[(ProcessStatus, i64)]) -> Value {
    Value::Array(
        counts
            .iter()
            .map(|(s, n)| json!({"status": s.as_str(), "count": n}))
            .collect(),
    )
}

impl Admin {
    /// One page of the processes matching `query`: `{items, total, next, counts}` (`next` is the
    /// cursor of the following page, null on the last; `counts` by status, of every process).
    pub async fn find(&self, pool: &PgPool, query: &Query) -> Result<Value, ConsoleError> {
        let page = find::page(pool, &self.schema, query).await.map_err(error)?;
        let items = page
            .items
            .iter()
            .map(summary)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(json!({
            "items": items,
            "total": page.total,
            "next": page.next.map(cursor::after_process),
            "counts": counts_json(&page.counts),
        }))
    }

    /// Every process matching `query` with the version seen now (a bulk request freezes these).
    pub async fn matching(
        &self,
        pool: &PgPool,
        query: &Query,
    ) -> Result<Vec<Selected>, ConsoleError> {
        find::matching(pool, &self.schema, query)
            .await
            .map_err(error)
    }
}
