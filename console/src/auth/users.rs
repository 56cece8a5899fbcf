//! Identities: users with one role and one bearer token, stored as its SHA-256.
//!
//! A token is `ct_` followed by 64 hex digits (256 random bits). It is shown once, by
//! `console user create`, and never stored; revoking a user ends its token and its sessions.

use crate::auth::roles::Role;
use crate::error::ConsoleError;
use rand::RngCore;
use serde::Serialize;
use sha2::{Digest, Sha256};
use shared::schema::Schema;
use sqlx::PgPool;
use utoipa::ToSchema;
use uuid::Uuid;

/// Who is asking: the authenticated user.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Principal {
    pub id: Uuid,
    pub name: String,
    pub role: Role,
}

/// A principal the console authenticated: from a bearer token (`api::authenticate`), or the web
/// session whose form `api::forward` passes on. Only the console puts it into a request.
#[derive(Debug, Clone)]
pub struct Authenticated(pub(crate) Principal);

/// A new random secret with the console prefix (tokens and session ids).
pub fn new_secret() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("ct_{}", hex::encode(bytes))
}

/// SHA-256 of a secret, as stored.
pub fn hash(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

/// Creates a user and returns it with its token (the only time the token exists outside the
/// user's hands).
pub async fn create(
    pool: &PgPool,
    schema: &Schema,
    name: &str,
    role: Role,
) -> Result<(Principal, String), ConsoleError> {
    if name.trim().is_empty() || name.len() > 200 || name.chars().any(char::is_control) {
        return Err(ConsoleError::BadRequest(
            "a user name is 1 to 200 printable characters".into(),
        ));
    }
    let token = new_secret();
    let id: Result<Uuid, sqlx::Error> = sqlx::query_scalar(schema.sql(
        "INSERT INTO {{schema}}.console_users (name, role, token_hash) VALUES ($1, $2, $3) RETURNING id",
    ))
    .bind(name)
    .bind(role.as_str())
    .bind(hash(&token))
    .fetch_one(pool)
    .await;
    match id {
        Ok(id) => Ok((
            Principal {
                id,
                name: name.to_string(),
                role,
            },
            token,
        )),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Err(ConsoleError::Conflict(
            format!("a user named {name:?} exists already"),
        )),
        Err(e) => Err(e.into()),
    }
}

/// Revokes the (active) user `name`: its token and sessions stop working. Returns whether one was
/// revoked.
pub async fn revoke(pool: &PgPool, schema: &Schema, name: &str) -> Result<bool, ConsoleError> {
    let mut tx = pool.begin().await?;
    let id: Option<Uuid> = sqlx::query_scalar(schema.sql(
        "UPDATE {{schema}}.console_users SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL RETURNING id",
    ))
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(id) = id {
        sqlx::query(schema.sql("DELETE FROM {{schema}}.console_sessions WHERE user_id = $1"))
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(id.is_some())
}

/// Active users, by name.
pub async fn list(pool: &PgPool, schema: &Schema) -> Result<Vec<Principal>, ConsoleError> {
    let rows: Vec<(Uuid, String, String)> = sqlx::query_as(schema.sql(
        "SELECT id, name, role FROM {{schema}}.console_users WHERE revoked_at IS NULL ORDER BY name",
    ))
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(id, name, role)| {
            Some(Principal {
                id,
                name,
                role: role.parse().ok()?,
            })
        })
        .collect())
}

/// The active user holding `token`.
pub async fn by_token(
    pool: &PgPool,
    schema: &Schema,
    token: &str,
) -> Result<Option<Principal>, ConsoleError> {
    let row: Option<(Uuid, String, String)> = sqlx::query_as(schema.sql(
        "SELECT id, name, role FROM {{schema}}.console_users WHERE token_hash = $1 AND revoked_at IS NULL",
    ))
    .bind(hash(token))
    .fetch_optional(pool)
    .await?;
    Ok(row.and_then(|(id, name, role)| {
        Some(Principal {
            id,
            name,
            role: role.parse().ok()?,
        })
    }))
}
