//! The example consumer that makes the order of application visible from outside (issue 22,
//! ordered consumers), run by `producer timeline`: every event it applies appends one row to
//! `demo.timeline` (consumer, aggregate, `aggregate_seq`, `message_id`, event type), in the
//! transaction that records the event as applied (its deduplication row, or in ordered mode its
//! aggregate's position). Reading one aggregate's rows in `position` order
//! shows the order in which that consumer applied its events; [`violations`] counts what ordered,
//! exactly-once application must never produce.
//!
//! Registered as the catch-all handler: every event type the queue is bound to is recorded.
//! Nothing is unique in the table on purpose, so an event applied twice is two rows, not an error.

use consumer::{Handler, HandlerError, Handlers};
use shared::Envelope;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// Appends one `demo.timeline` row per applied event, under the consumer's name.
///
/// Its statements are unnamed (`.persistent(false)`), so it runs unchanged behind a transaction
/// pooler (`DATABASE_POOLER=transaction`); a batch is one statement, so that costs little.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimelineHandler {
    /// The consumer's name (`--name`), written in every row.
    pub consumer: String,
}

impl Handler for TimelineHandler {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        self.handle_batch(tx, &[msg]).await
    }

    /// The whole batch as one multi-row INSERT, rows taking their `position` in the order of
    /// `msgs` (the order the runtime applies them in). [`TimelineHandler::handle`] is the same
    /// statement for one message.
    async fn handle_batch(
        &self,
        tx: &mut PgConnection,
        msgs: &[&Envelope],
    ) -> Result<(), HandlerError> {
        let mut aggregate_types = Vec::with_capacity(msgs.len());
        let mut aggregate_ids = Vec::with_capacity(msgs.len());
        let mut aggregate_seqs: Vec<Option<i64>> = Vec::with_capacity(msgs.len());
        let mut message_ids: Vec<Uuid> = Vec::with_capacity(msgs.len());
        let mut event_types = Vec::with_capacity(msgs.len());
        for msg in msgs {
            aggregate_types.push(msg.aggregate_type.as_str());
            aggregate_ids.push(msg.aggregate_id.as_str());
            aggregate_seqs.push(msg.aggregate_seq);
            message_ids.push(msg.message_id);
            event_types.push(msg.event_type.as_str());
        }
        // ORDER BY the ordinality: `position` defaults are drawn after the sort, in slice order.
        sqlx::query(
            "INSERT INTO demo.timeline \
             (consumer, aggregate_type, aggregate_id, aggregate_seq, message_id, event_type) \
             SELECT $1::text, t.aggregate_type, t.aggregate_id, t.aggregate_seq, t.message_id, \
                    t.event_type \
             FROM unnest($2::text[], $3::text[], $4::bigint[], $5::uuid[], $6::text[]) \
                  WITH ORDINALITY \
                  AS t (aggregate_type, aggregate_id, aggregate_seq, message_id, event_type, n) \
             ORDER BY t.n",
        )
        .bind(&self.consumer)
        .bind(&aggregate_types)
        .bind(&aggregate_ids)
        .bind(&aggregate_seqs)
        .bind(&message_ids)
        .bind(&event_types)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// The handlers of `producer timeline`: [`TimelineHandler`] for every event type (catch-all, so
/// the queue is bound to `#` unless `--bind` says otherwise).
pub fn handlers(consumer: impl Into<String>) -> Handlers {
    Handlers::new().fallback(TimelineHandler {
        consumer: consumer.into(),
    })
}

/// What `demo.timeline` shows of one consumer that ordered, exactly-once application never
/// produces. Both are 0 for a correct run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Violations {
    /// Rows whose `aggregate_seq` is lower than or equal to that of the row just before them
    /// (by `position`) of the same aggregate: each step backwards (or in place) counts once.
    /// Rows without `aggregate_seq`, and the rows right after them, are not compared.
    pub out_of_order: i64,
    /// Messages (`message_id`) with more than one row.
    pub applied_twice: i64,
}

/// Counts the [`Violations`] in `demo.timeline` for `consumer`, in one statement (one snapshot).
pub async fn violations(pool: &PgPool, consumer: &str) -> Result<Violations, sqlx::Error> {
    let (out_of_order, applied_twice): (i64, i64) = sqlx::query_as(
        "WITH rows AS ( \
             SELECT message_id, aggregate_seq, \
                    lag(aggregate_seq) OVER ( \
                        PARTITION BY aggregate_type, aggregate_id ORDER BY position) AS previous \
             FROM demo.timeline WHERE consumer = $1 \
         ) \
         SELECT \
             (SELECT count(*) FROM rows WHERE aggregate_seq <= previous), \
             (SELECT count(*) FROM ( \
                  SELECT 1 FROM rows GROUP BY message_id HAVING count(*) > 1) AS twice)",
    )
    .bind(consumer)
    .persistent(false)
    .fetch_one(pool)
    .await?;
    Ok(Violations {
        out_of_order,
        applied_twice,
    })
}
