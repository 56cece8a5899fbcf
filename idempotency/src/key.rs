//! The `Idempotency-Key` header: exactly one, 1 to 255 printable ASCII characters (0x20-0x7E),
//! not only spaces. The producer keeps only its SHA-256.

use crate::error::IdempotencyError;
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

/// Request header carrying the key.
pub const KEY_HEADER: &str = "idempotency-key";
/// Longest accepted key.
pub const MAX_KEY_LEN: usize = 255;

/// The SHA-256 of a validated key: all that is stored of it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyHash(pub [u8; 32]);

impl std::fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyHash({}…)", hex::encode(&self.0[..6]))
    }
}

impl KeyHash {
    /// A short, non-reversible id for logs.
    pub fn log_id(&self) -> String {
        hex::encode(&self.0[..6])
    }
}

/// SHA-256 of a key as sent.
pub fn hash_key(key: &str) -> KeyHash {
    KeyHash(Sha256::digest(key.as_bytes()).into())
}

/// Checks a raw key: 1 to 255 printable ASCII characters (0x20-0x7E), not only spaces.
pub fn validate_key(raw: &[u8]) -> Result<&str, IdempotencyError> {
    if raw.iter().all(|b| *b == b' ' || *b == b'\t') {
        return Err(IdempotencyError::BadKey(
            "Idempotency-Key must not be empty".into(),
        ));
    }
    if raw.len() > MAX_KEY_LEN {
        return Err(IdempotencyError::BadKey(format!(
            "Idempotency-Key must be at most {MAX_KEY_LEN} characters"
        )));
    }
    if !raw.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return Err(IdempotencyError::BadKey(
            "Idempotency-Key must consist of printable ASCII characters".into(),
        ));
    }
    std::str::from_utf8(raw)
        .map_err(|_| IdempotencyError::BadKey("Idempotency-Key must be ASCII".into()))
}

/// The key of a request: exactly one valid `Idempotency-Key` header, hashed.
pub fn key_from_headers(headers: &HeaderMap) -> Result<KeyHash, IdempotencyError> {
    let mut values = headers.get_all(KEY_HEADER).iter();
    let Some(value) = values.next() else {
        return Err(IdempotencyError::BadKey(
            "Idempotency-Key header is required".into(),
        ));
    };
    if values.next().is_some() {
        return Err(IdempotencyError::BadKey(
            "only one Idempotency-Key header is allowed".into(),
        ));
    }
    validate_key(value.as_bytes()).map(hash_key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_rules() {
        assert!(validate_key(b"abc").is_ok());
        assert!(validate_key(b"'; DROP TABLE orders; --").is_ok());
        assert!(validate_key(&[b'k'; 255]).is_ok());
        assert!(validate_key(&[b'k'; 256]).is_err());
        assert!(validate_key(b"").is_err());
        assert!(validate_key(b"   ").is_err());
        assert!(validate_key(b"a\tb").is_err());
        assert!(validate_key("kéy".as_bytes()).is_err());
        assert!(validate_key(b"a\x7fb").is_err());
    }

    #[test]
    fn exactly_one_header() {
        let mut h = HeaderMap::new();
        assert!(key_from_headers(&h).is_err());
        h.append(KEY_HEADER, "one".parse().unwrap());
        assert_eq!(key_from_headers(&h).unwrap(), hash_key("one"));
        h.append(KEY_HEADER, "two".parse().unwrap());
        assert!(key_from_headers(&h).is_err());
    }
}
