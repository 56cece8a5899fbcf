//! A consumer's dead letters a page at a time, and "all that match". A queue has no index: a page
//! is a position from its head (the cursor), read without removing anything, and "N of M" takes
//! M from the queue's depth. A letter replayed or added between two pages shifts the positions;
//! the replay itself is safe either way (each item names its message id and version).

use super::cursor::{self, List, Page};
use super::dead_letters::{Item, Letter, check_consumer, letter};
use crate::error::ConsoleError;
use plumbing::amqp_tls::AmqpTls;

/// The most letters one "all that match" request freezes: beyond, it is refused (never cut).
pub const MAX_ALL: usize = 1000;

/// A page of dead letters; `total` is how many letters the queue holds (its depth).
pub type LetterPage = Page<Letter, usize>;

/// One page of `consumer`'s dead letters after the cursor `after` (anything else is a 400).
pub async fn page(
    amqp_url: &str,
    tls: &AmqpTls,
    consumer: &str,
    after: Option<&str>,
    limit: Option<usize>,
) -> Result<LetterPage, ConsoleError> {
    check_consumer(consumer)?;
    let skip = after
        .filter(|a| !a.is_empty())
        .map(|a| cursor::position(List::DeadLetters, a))
        .transpose()?
        .unwrap_or(0);
    let skip = usize::try_from(skip).map_err(|_| {
        ConsoleError::BadRequest("after: not a cursor of this list (take it from `next`)".into())
    })?;
    let limit = limit.unwrap_or(100).clamp(1, 500);
    let (letters, total) = consumer::dlq::page(amqp_url, tls, consumer, skip, limit).await?;
    let shown = skip + letters.len();
    let next = (shown < total && !letters.is_empty())
        .then(|| cursor::encode(List::DeadLetters, &shown.to_string()));
    Ok(LetterPage {
        items: letters.into_iter().map(letter).collect(),
        total,
        next,
    })
}

/// Every dead letter of `consumer` with its version now: what "all that match" freezes. A letter
/// without a message id cannot be named in a replay and is left out (the dry run shows the count).
/// More than [`MAX_ALL`] is a 400.
pub async fn all(amqp_url: &str, tls: &AmqpTls, consumer: &str) -> Result<Vec<Item>, ConsoleError> {
    check_consumer(consumer)?;
    let (letters, total) = consumer::dlq::page(amqp_url, tls, consumer, 0, MAX_ALL + 1).await?;
    if total > MAX_ALL || letters.len() > MAX_ALL {
        return Err(ConsoleError::BadRequest(format!(
            "more than {MAX_ALL} dead letters: select them a page at a time"
        )));
    }
    Ok(letters
        .into_iter()
        .filter_map(|d| {
            Some(Item {
                message_id: d.message_id?,
                version: d.dead_lettered_at.unwrap_or_default(),
            })
        })
        .collect())
}
