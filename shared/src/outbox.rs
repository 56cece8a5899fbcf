//! The Rust producer API: add events to the outbox inside the caller's transaction.
//!
//! Every function takes any [`sqlx::PgExecutor`], so pass `&mut *tx` and the event commits or rolls
//! back with the business change. Non-Rust producers use the plain SQL contract in README.md.
//!
//! Messages are checked against [`crate::publishable`] before anything is sent to the database: a
//! message that could never be published is an [`EnqueueError::Invalid`], and nothing is written.

use crate::envelope::NewMessage;
use crate::publishable::MessageError;
use crate::schema::Schema;
use uuid::Uuid;

/// Why a message was not added.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    /// The message breaks a publishability rule; nothing was sent to the database.
    #[error("message {id} cannot be published")]
    Invalid {
        id: Uuid,
        #[source]
        source: MessageError,
    },
    /// The INSERT failed.
    #[error("adding to the outbox failed")]
    Database(#[from] sqlx::Error),
}

/// So that `?` works in code that returns `sqlx::Error` (a consumer handler, a repository): an
/// invalid message becomes [`sqlx::Error::Encode`], which carries the [`MessageError`].
impl From<EnqueueError> for sqlx::Error {
    fn from(e: EnqueueError) -> Self {
        match e {
            EnqueueError::Database(e) => e,
            invalid @ EnqueueError::Invalid { .. } => sqlx::Error::Encode(Box::new(invalid)),
        }
    }
}

/// The outbox of one installation: where [`Outbox::enqueue`] writes. [`Outbox::default`] (and the
/// free functions [`enqueue`], [`enqueue_many`]) use the default schema `outbox`; a service that
/// configures another schema keeps one `Outbox` built from its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outbox {
    schema: Schema,
    named_statements: bool,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new(Schema::default())
    }
}

impl Outbox {
    pub fn new(schema: Schema) -> Self {
        Self {
            schema,
            named_statements: true,
        }
    }

    /// Whether statements are named prepared statements, cached per connection (the default,
    /// one round trip each). Set `false` for a connection through a transaction pooler that does
    /// not track them (PgBouncer before 1.21 in `pool_mode = transaction`, where a named
    /// statement fails with `prepared statement "sqlx_s_1" does not exist`): each statement is
    /// then parsed anew, one round trip more.
    pub fn named_statements(mut self, named: bool) -> Self {
        self.named_statements = named;
        self
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Adds one event to the outbox and returns its message id.
    pub async fn enqueue<'e, E>(&self, executor: E, msg: &NewMessage) -> Result<Uuid, EnqueueError>
    where
        E: sqlx::PgExecutor<'e>,
    {
        msg.check()
            .map_err(|source| EnqueueError::Invalid { id: msg.id, source })?;
        sqlx::query(self.schema.sql(
            "INSERT INTO {{schema}}.messages (id, aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        ))
        .bind(msg.id)
        .bind(&msg.aggregate_type)
        .bind(&msg.aggregate_id)
        .bind(&msg.event_type)
        .bind(sqlx::types::Json(&msg.payload))
        .bind(sqlx::types::Json(&msg.headers))
        .persistent(self.named_statements)
        .execute(executor)
        .await?;
        Ok(msg.id)
    }

    /// Adds many events with one statement (one round trip, one NOTIFY) and returns their ids in
    /// order. Within one aggregate they are published in the order given. All or nothing: one
    /// invalid message and none is added.
    pub async fn enqueue_many<'e, E>(
        &self,
        executor: E,
        msgs: &[NewMessage],
    ) -> Result<Vec<Uuid>, EnqueueError>
    where
        E: sqlx::PgExecutor<'e>,
    {
        if msgs.is_empty() {
            return Ok(Vec::new());
        }
        for msg in msgs {
            msg.check()
                .map_err(|source| EnqueueError::Invalid { id: msg.id, source })?;
        }
        let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
        let aggregate_types: Vec<&str> = msgs.iter().map(|m| m.aggregate_type.as_str()).collect();
        let aggregate_ids: Vec<&str> = msgs.iter().map(|m| m.aggregate_id.as_str()).collect();
        let event_types: Vec<&str> = msgs.iter().map(|m| m.event_type.as_str()).collect();
        let payloads: Vec<String> = msgs.iter().map(|m| m.payload.to_string()).collect();
        let headers: Vec<String> = msgs
            .iter()
            .map(|m| serde_json::Value::Object(m.headers.clone()).to_string())
            .collect();
        // WITH ORDINALITY + ORDER BY keeps the identity (seq) in the order given.
        sqlx::query(self.schema.sql(
            "INSERT INTO {{schema}}.messages (id, aggregate_type, aggregate_id, event_type, payload, headers) \
             SELECT id, aggregate_type, aggregate_id, event_type, payload::jsonb, headers::jsonb \
             FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[]) \
                  WITH ORDINALITY AS t(id, aggregate_type, aggregate_id, event_type, payload, headers, n) \
             ORDER BY n",
        ))
        .bind(&ids)
        .bind(&aggregate_types)
        .bind(&aggregate_ids)
        .bind(&event_types)
        .bind(&payloads)
        .bind(&headers)
        .persistent(self.named_statements)
        .execute(executor)
        .await?;
        Ok(ids)
    }

    /// Serializes this transaction with every other transaction that locks the same aggregate,
    /// until commit.
    ///
    /// The outbox no longer needs it for its order: since migration 8 the first message of an
    /// aggregate in a transaction locks that aggregate's sequence counter to commit, so commits of
    /// one aggregate follow their `aggregate_seq`. Call it only to serialize what the transaction
    /// does *before* its first message (a read-then-write of business state), as any advisory lock.
    pub async fn lock_aggregate<'e, E>(
        &self,
        executor: E,
        aggregate_id: &str,
    ) -> Result<(), sqlx::Error>
    where
        E: sqlx::PgExecutor<'e>,
    {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7))")
            .bind(aggregate_id)
            .persistent(self.named_statements)
            .execute(executor)
            .await?;
        Ok(())
    }
}

/// [`Outbox::enqueue`] into the default schema (`outbox`).
pub async fn enqueue<'e, E>(executor: E, msg: &NewMessage) -> Result<Uuid, EnqueueError>
where
    E: sqlx::PgExecutor<'e>,
{
    Outbox::default().enqueue(executor, msg).await
}

/// [`Outbox::enqueue_many`] into the default schema (`outbox`).
pub async fn enqueue_many<'e, E>(
    executor: E,
    msgs: &[NewMessage],
) -> Result<Vec<Uuid>, EnqueueError>
where
    E: sqlx::PgExecutor<'e>,
{
    Outbox::default().enqueue_many(executor, msgs).await
}

/// [`Outbox::lock_aggregate`] with named statements.
pub async fn lock_aggregate<'e, E>(executor: E, aggregate_id: &str) -> Result<(), sqlx::Error>
where
    E: sqlx::PgExecutor<'e>,
{
    Outbox::default()
        .lock_aggregate(executor, aggregate_id)
        .await
}
