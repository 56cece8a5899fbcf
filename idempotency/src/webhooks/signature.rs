//! The signature of a webhook: `<Header>: t=<unix seconds>,v1=<hex HMAC-SHA256(secret,
//! "<t>.<raw body>")>[,v1=...]`, Stripe's scheme. [`Signature::parse`] reads the header without
//! trusting it; [`Signature::verify`] compares every `v1` with the MAC under every secret in
//! constant time (`hmac`'s `verify_slice`), over the raw body bytes, before anything parses the
//! body, and then refuses a timestamp outside the tolerance (a replay of an old delivery).

use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::Duration;

/// At most this many comma-separated items in a header (several `v1` during a secret rotation);
/// more is refused instead of costing a MAC each.
pub const MAX_ITEMS: usize = 16;

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// No signature header: 401.
    #[error("missing {0} header: the webhook is not signed")]
    Unsigned(&'static str),
    /// The header is there but not `t=<digits>,v1=<64 hex>`: 400.
    #[error("malformed {header} header: {reason}")]
    Malformed {
        header: &'static str,
        reason: &'static str,
    },
    /// No `v1` matches the body under any secret: 401.
    #[error("the signature does not match the body")]
    Mismatch,
    /// Signed, but at a time outside the tolerance: a replay or a badly wrong clock; 401.
    #[error(
        "the signature timestamp is {age_secs} s away from now, over the tolerance of {tolerance_secs} s"
    )]
    Stale { age_secs: i64, tolerance_secs: u64 },
}

impl SignatureError {
    /// The label of `webhook_signature_failures_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            SignatureError::Unsigned(_) => "unsigned",
            SignatureError::Malformed { .. } => "malformed",
            SignatureError::Mismatch => "mismatch",
            SignatureError::Stale { .. } => "stale",
        }
    }
}

/// A parsed, not yet verified, signature header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    /// `t`, Unix seconds.
    pub timestamp: i64,
    /// Every `v1`, decoded.
    pub v1: Vec<[u8; 32]>,
}

impl Signature {
    /// Reads `t=..,v1=..` (items in any order; unknown keys such as `v0` ignored). `header` names
    /// the header in error messages.
    pub fn parse(value: &[u8], header: &'static str) -> Result<Self, SignatureError> {
        let malformed = |reason| SignatureError::Malformed { header, reason };
        let text = std::str::from_utf8(value).map_err(|_| malformed("not ASCII"))?;
        let mut timestamp = None;
        let mut v1 = Vec::new();
        for (i, item) in text.split(',').enumerate() {
            if i >= MAX_ITEMS {
                return Err(malformed("too many items"));
            }
            let (key, val) = item
                .trim()
                .split_once('=')
                .ok_or_else(|| malformed("items must be key=value"))?;
            match key {
                "t" => {
                    if timestamp.is_some() {
                        return Err(malformed("t is given twice"));
                    }
                    if val.is_empty() || val.len() > 12 || !val.bytes().all(|b| b.is_ascii_digit())
                    {
                        return Err(malformed("t must be Unix seconds"));
                    }
                    timestamp = Some(
                        val.parse::<i64>()
                            .map_err(|_| malformed("t must be Unix seconds"))?,
                    );
                }
                "v1" => {
                    let mut mac = [0u8; 32];
                    hex::decode_to_slice(val, &mut mac)
                        .map_err(|_| malformed("v1 must be 64 hex digits"))?;
                    v1.push(mac);
                }
                _ => {}
            }
        }
        let timestamp = timestamp.ok_or_else(|| malformed("no t=<timestamp>"))?;
        if v1.is_empty() {
            return Err(malformed("no v1=<signature>"));
        }
        Ok(Self { timestamp, v1 })
    }

    /// Whether some `v1` is the MAC of `body` under some secret (constant-time comparisons), then
    /// whether `t` is within `tolerance` of `now` (either side). Returns the signing time.
    pub fn verify(
        &self,
        secrets: &[Vec<u8>],
        body: &[u8],
        now: DateTime<Utc>,
        tolerance: Duration,
    ) -> Result<DateTime<Utc>, SignatureError> {
        let matches = secrets.iter().any(|secret| {
            self.v1.iter().any(|candidate| {
                mac(secret, self.timestamp, body)
                    .verify_slice(candidate)
                    .is_ok()
            })
        });
        if !matches {
            return Err(SignatureError::Mismatch);
        }
        let age_secs = now.timestamp().saturating_sub(self.timestamp);
        let tolerance_secs = tolerance.as_secs();
        if age_secs.unsigned_abs() > tolerance_secs {
            return Err(SignatureError::Stale {
                age_secs,
                tolerance_secs,
            });
        }
        DateTime::from_timestamp(self.timestamp, 0).ok_or(SignatureError::Stale {
            age_secs,
            tolerance_secs,
        })
    }
}

/// The MAC over `"<t>.<body>"`, ready to compare or finalize.
fn mac(secret: &[u8], t: i64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac =
        Hmac::<Sha256>::new_from_slice(secret).expect("HMAC-SHA256 accepts keys of any length");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The header value a provider would send for `body` at `t`: for tests, examples and senders.
pub fn sign(secret: &[u8], t: i64, body: &[u8]) -> String {
    format!(
        "t={t},v1={}",
        hex::encode(mac(secret, t, body).finalize().into_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "Provider-Signature";

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    #[test]
    fn same_vector_as_openssl() {
        // printf '1700000000.{}' | openssl dgst -sha256 -hmac whsec
        assert_eq!(
            sign(b"whsec", 1_700_000_000, b"{}"),
            "t=1700000000,v1=7d44587dddbaf4c7f70fef20f48cd594834ffea1641e3ac227b84408298738af"
        );
    }

    #[test]
    fn verifies_and_refuses() {
        let secrets = vec![b"old".to_vec(), b"whsec".to_vec()];
        let tol = Duration::from_secs(300);
        let good = sign(b"whsec", 1_700_000_000, b"{}");
        let sig = Signature::parse(good.as_bytes(), H).unwrap();
        assert_eq!(sig.verify(&secrets, b"{}", now(), tol), Ok(now()));
        assert_eq!(
            sig.verify(&secrets, b"{ }", now(), tol),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            sig.verify(&[b"other".to_vec()], b"{}", now(), tol),
            Err(SignatureError::Mismatch)
        );
        let late = now() + chrono::TimeDelta::seconds(301);
        assert!(matches!(
            sig.verify(&secrets, b"{}", late, tol),
            Err(SignatureError::Stale { age_secs: 301, .. })
        ));
        let early = now() - chrono::TimeDelta::seconds(301);
        assert!(matches!(
            sig.verify(&secrets, b"{}", early, tol),
            Err(SignatureError::Stale { age_secs: -301, .. })
        ));
        // A rotation: two v1, one of them right, in any order, with an unknown scheme ignored.
        let v1 = good.split_once(",v1=").unwrap().1;
        let rotated = format!("v0=abc, v1={}, t=1700000000, v1={v1}", "0".repeat(64));
        let sig = Signature::parse(rotated.as_bytes(), H).unwrap();
        assert_eq!(sig.verify(&secrets, b"{}", now(), tol), Ok(now()));
    }

    #[test]
    fn malformed_headers() {
        for bad in [
            "",
            "garbage",
            "t=1700000000",
            "v1=00",
            &format!("t=,v1={}", "0".repeat(64)),
            &format!("t=-5,v1={}", "0".repeat(64)),
            &format!("t=1,t=2,v1={}", "0".repeat(64)),
            &format!("t=1,v1={}", "g".repeat(64)),
            &format!("t=1,v1={}", "0".repeat(63)),
            &format!("t=99999999999999999999,v1={}", "0".repeat(64)),
            &"x=1,".repeat(20),
        ] {
            assert!(
                matches!(
                    Signature::parse(bad.as_bytes(), H),
                    Err(SignatureError::Malformed { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(Signature::parse(b"\xff\xfe", H).is_err());
    }
}
