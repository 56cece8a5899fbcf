//! The audit log a page at a time: newest first, keyset pages over `seq` (`seq < cursor`, one
//! range of the primary key however deep), with how many entries match in all, so the list is
//! never cut silently.

use super::audit::{COLUMNS, Entry, FILTERED, Filter, redacted};
use crate::error::ConsoleError;
use crate::targets::cursor::{self, List, Page};
use shared::schema::Schema;
use sqlx::PgPool;

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
        "SELECT {COLUMNS} FROM {{{{schema}}}}.console_audit {FILTERED} \
         AND ($6::bigint IS NULL OR seq < $6) ORDER BY seq DESC LIMIT $7"
    );
    let mut rows = sqlx::query_as_with::<_, Entry, _>(schema.sql(&sql), f.arguments()?)
        .bind(after)
        .bind(limit + 1)
        .fetch_all(pool)
        .await?;
    let next = cursor::cut_page(&mut rows, limit, List::Audit, |e| e.seq);
    let total: i64 = sqlx::query_scalar_with(
        schema.sql(&format!(
            "SELECT count(*) FROM {{{{schema}}}}.console_audit {FILTERED}"
        )),
        f.arguments()?,
    )
    .fetch_one(pool)
    .await?;
    let items = rows.into_iter().map(redacted).collect();
    Ok(AuditPage { items, total, next })
}
