//! The audit log a page at a time: newest first, keyset pages over `seq` (`seq < cursor`, one
//! range of the primary key however deep), with how many entries match in all, so the list is
//! never cut silently.

use super::audit::{Entry, Filter};
use crate::error::ConsoleError;
use crate::redact;
use crate::targets::cursor::{self, List, Page};
use shared::schema::Schema;
use sqlx::PgPool;

/// The filters of [`Filter`], `$1` to `$5`.
const WHERE: &str = "WHERE ($1::text IS NULL OR actor_name = $1) AND ($2::text IS NULL OR action = $2) \
    AND ($3::text IS NULL OR outcome = $3) AND ($4::text IS NULL OR strpos(target, $4) > 0) \
    AND ($5::timestamptz IS NULL OR at >= $5)";

/// A page of the audit log; `total` is how many entries match in all.
pub type AuditPage = Page<Entry>;

/// One page of entries matching `f` after `f.after` (a cursor of this list; anything else is a
/// 400).
pub async fn page(pool: &PgPool, schema: &Schema, f: &Filter) -> Result<AuditPage, ConsoleError> {
    let after = f
        .after
        .as_deref()
        .filter(|a| !a.is_empty())
        .map(|a| cursor::position(List::Audit, a))
        .transpose()?;
    let limit = f.limit.unwrap_or(200).clamp(1, 1000);
    let sql = format!(
        "SELECT seq, at, actor_id, actor_name, roles, action, target, reason, approval_id, approver, before, after, outcome \
         FROM {{{{schema}}}}.console_audit {WHERE} AND ($6::bigint IS NULL OR seq < $6) \
         ORDER BY seq DESC LIMIT $7"
    );
    let mut rows = sqlx::query_as::<_, Entry>(schema.sql(&sql))
        .bind(&f.actor)
        .bind(&f.action)
        .bind(&f.outcome)
        .bind(&f.target)
        .bind(f.since)
        .bind(after)
        .bind(limit + 1)
        .fetch_all(pool)
        .await?;
    let next = cursor::cut_page(&mut rows, limit, List::Audit, |e| e.seq);
    let total: i64 = sqlx::query_scalar(schema.sql(&format!(
        "SELECT count(*) FROM {{{{schema}}}}.console_audit {WHERE}"
    )))
    .bind(&f.actor)
    .bind(&f.action)
    .bind(&f.outcome)
    .bind(&f.target)
    .bind(f.since)
    .fetch_one(pool)
    .await?;
    let items = rows
        .into_iter()
        .map(|mut e| {
            e.target = redact::text(&e.target);
            e.reason = redact::text(&e.reason);
            e.before = e.before.as_ref().map(redact::value);
            e.after = e.after.as_ref().map(redact::value);
            e
        })
        .collect();
    Ok(AuditPage { items, total, next })
}
