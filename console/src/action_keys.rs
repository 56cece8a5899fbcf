//! Idempotency of console actions.
//!
//! SEAM(idempotency crate): the lead replaces this module with the `idempotency` crate's axum
//! layer (records in `idempotency_keys`, scope = the console user). Until then this interim
//! version gives the guarantee the console needs: a repeated action request with the same
//! `Idempotency-Key` from the same user replays the stored response and repeats no effect, because
//! the key is inserted in the action's own transaction, before the effect (a concurrent duplicate
//! waits on the primary key and then finds the stored response), and the response is stored in
//! that same transaction. The same key with another request answers 422.

use crate::error::ConsoleError;
use sha2::{Digest, Sha256};
use shared::schema::Schema;
use sqlx::PgConnection;
use uuid::Uuid;

/// The header.
pub const HEADER: &str = "idempotency-key";

/// A key presented with a request.
#[derive(Debug, Clone)]
pub struct Key {
    hash: Vec<u8>,
    fingerprint: Vec<u8>,
}

impl Key {
    /// `key` (1 to 255 printable ASCII characters) for the request `method path body`.
    pub fn new(key: &str, method: &str, path: &str, body: &[u8]) -> Result<Self, ConsoleError> {
        if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return Err(ConsoleError::BadRequest(
                "Idempotency-Key must be 1 to 255 printable ASCII characters".into(),
            ));
        }
        let mut f = Sha256::new();
        f.update(method.as_bytes());
        f.update([0]);
        f.update(path.as_bytes());
        f.update([0]);
        f.update(body);
        Ok(Self {
            hash: Sha256::digest(key.as_bytes()).to_vec(),
            fingerprint: f.finalize().to_vec(),
        })
    }
}

/// A response stored for a key.
#[derive(Debug, Clone)]
pub struct Stored {
    pub status: u16,
    pub body: String,
}

/// Reserves `key` for `user` inside the action's transaction. `Some` when the key was used
/// before: the stored response to replay.
pub async fn begin(
    conn: &mut PgConnection,
    schema: &Schema,
    user: Uuid,
    key: &Key,
) -> Result<Option<Stored>, ConsoleError> {
    // The placeholder response is overwritten by `finish` in the same transaction; nobody else
    // ever sees it.
    let inserted = sqlx::query(schema.sql(
        "INSERT INTO {{schema}}.console_action_keys (user_id, key_hash, fingerprint, response_status, response_body) \
         VALUES ($1, $2, $3, 500, '') ON CONFLICT DO NOTHING",
    ))
    .bind(user)
    .bind(&key.hash)
    .bind(&key.fingerprint)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(None);
    }
    let (fingerprint, status, body): (Vec<u8>, i16, String) = sqlx::query_as(schema.sql(
        "SELECT fingerprint, response_status, response_body FROM {{schema}}.console_action_keys \
         WHERE user_id = $1 AND key_hash = $2",
    ))
    .bind(user)
    .bind(&key.hash)
    .fetch_one(&mut *conn)
    .await?;
    if fingerprint != key.fingerprint {
        return Err(ConsoleError::Unprocessable(
            "this Idempotency-Key was used for another request".into(),
        ));
    }
    Ok(Some(Stored {
        status: status as u16,
        body,
    }))
}

/// Stores the response of the action that reserved `key`, in its transaction.
pub async fn finish(
    conn: &mut PgConnection,
    schema: &Schema,
    user: Uuid,
    key: &Key,
    status: u16,
    body: &str,
) -> Result<(), ConsoleError> {
    sqlx::query(schema.sql(
        "UPDATE {{schema}}.console_action_keys SET response_status = $3, response_body = $4 \
         WHERE user_id = $1 AND key_hash = $2",
    ))
    .bind(user)
    .bind(&key.hash)
    .bind(status as i16)
    .bind(body)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
