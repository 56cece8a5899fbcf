//! Bearer API keys mapped to tenants. Keys are 256-bit random values shown once at creation; the
//! database keeps their SHA-256 only. Every API route requires one; a missing or unknown key gets
//! 401 before anything else happens (no idempotency record, no body parsing).

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

/// Prefix of every key, so leaked keys are easy to recognise (secret scanners).
pub const KEY_PREFIX: &str = "opk_";
/// Longest bearer token even looked up.
const MAX_TOKEN_LEN: usize = 256;

/// The authenticated tenant of a request (a request extension set by the auth middleware).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

/// Errors of API key management.
#[derive(Debug, thiserror::Error)]
pub enum ApiKeyError {
    #[error(
        "invalid tenant name (1-64 characters: letters, digits, '.', '_', '-'; starting with a letter or digit)"
    )]
    InvalidTenant,
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

/// Whether `name` is an acceptable tenant name.
pub fn valid_tenant(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 64
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// SHA-256 of a key as presented.
pub fn hash_api_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A fresh key: `opk_` and 64 hex digits (256 random bits).
pub fn generate_api_key() -> String {
    format!("{KEY_PREFIX}{}", hex::encode(rand::random::<[u8; 32]>()))
}

/// Creates a key for `tenant` and returns it; only its hash is stored, so this is the one time it
/// can be seen.
pub async fn create_api_key(pool: &PgPool, tenant: &str) -> Result<String, ApiKeyError> {
    if !valid_tenant(tenant) {
        return Err(ApiKeyError::InvalidTenant);
    }
    let key = generate_api_key();
    sqlx::query(
        "INSERT INTO demo.api_keys (id, tenant, key_hash, key_prefix) VALUES ($1, $2, $3, $4)",
    )
    .bind(Uuid::now_v7())
    .bind(tenant)
    .bind(&hash_api_key(&key)[..])
    .bind(&key[..KEY_PREFIX.len() + 8])
    .execute(pool)
    .await?;
    Ok(key)
}

/// The tenant of a key, if the key exists and is not revoked.
pub async fn tenant_for_key(pool: &PgPool, key: &str) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT tenant FROM demo.api_keys WHERE key_hash = $1 AND revoked_at IS NULL",
    )
    .bind(&hash_api_key(key)[..])
    .fetch_optional(pool)
    .await
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let (scheme, token) = value.to_str().ok()?.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() && token.len() <= MAX_TOKEN_LEN)
        .then_some(token)
}

/// Middleware: resolves the bearer key to a [`Tenant`] or answers 401.
pub(crate) async fn require_tenant(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(token) = bearer(request.headers()) else {
        return ApiError::Unauthorized.into_response();
    };
    match tenant_for_key(&state.pool, token).await {
        Ok(Some(tenant)) => {
            request.extensions_mut().insert(Tenant(tenant));
            next.run(request).await
        }
        Ok(None) => ApiError::Unauthorized.into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names() {
        assert!(valid_tenant("acme"));
        assert!(valid_tenant("acme-eu.1_x"));
        assert!(!valid_tenant(""));
        assert!(!valid_tenant("-acme"));
        assert!(!valid_tenant("ac me"));
        assert!(!valid_tenant(&"a".repeat(65)));
    }

    #[test]
    fn keys_are_random_and_prefixed() {
        let (a, b) = (generate_api_key(), generate_api_key());
        assert_ne!(a, b);
        assert!(a.starts_with(KEY_PREFIX));
        assert_eq!(a.len(), KEY_PREFIX.len() + 64);
    }

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "bearer  abc ".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(bearer(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer ".parse().unwrap());
        assert_eq!(bearer(&h), None);
    }
}
