//! Dead outbox rows a page at a time (oldest first, keyset pages over `seq`, read by
//! [`relay::dead_rows`]) with how many there are in all, and "all that match": every dead row with
//! its version, frozen for one requeue request.

use super::cursor::{self, List, Page};
use super::outbox_dead::{DeadRow, Item, redacted};
use crate::error::ConsoleError;
use shared::schema::Schema;
use sqlx::PgPool;

/// The most rows one "all that match" request freezes: beyond, it is refused (never cut).
pub const MAX_ALL: i64 = 1000;

/// A page of dead rows; `total` is how many rows are dead in all.
pub type DeadPage = Page<DeadRow>;

/// One page of dead rows after `after` (a cursor of this list; anything else is a 400).
pub async fn page(
    pool: &PgPool,
    schema: &Schema,
    after: Option<&str>,
    limit: Option<i64>,
) -> Result<DeadPage, ConsoleError> {
    let after = after
        .filter(|a| !a.is_empty())
        .map(|a| cursor::position(List::Dead, a))
        .transpose()?;
    let limit = limit.unwrap_or(100).clamp(1, 1000);
    let (mut rows, total) = relay::dead_rows::dead_page(pool, schema, after, limit + 1).await?;
    let next = cursor::cut_page(&mut rows, limit, List::Dead, |r| r.seq);
    let items = rows.into_iter().map(redacted).collect();
    Ok(DeadPage { items, total, next })
}

/// Every dead row with its version now, oldest first: what "all that match" freezes. More than
/// [`MAX_ALL`] is a 400 (requeue them in parts, never a silent cut).
pub async fn all(pool: &PgPool, schema: &Schema) -> Result<Vec<Item>, ConsoleError> {
    let rows = relay::dead_rows::dead_versions(pool, schema, MAX_ALL + 1).await?;
    if rows.len() as i64 > MAX_ALL {
        return Err(ConsoleError::BadRequest(format!(
            "more than {MAX_ALL} dead rows: select them a page at a time"
        )));
    }
    Ok(rows
        .into_iter()
        .map(|(id, version)| Item { id, version })
        .collect())
}
