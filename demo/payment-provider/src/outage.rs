//! The outage switch: while it is on, every call of the API (charges, lookups, refunds) is
//! answered 503 or 429 with a `Retry-After` before anything is done, as a provider that is down
//! or shedding load answers. Set at start (`PROVIDER_OUTAGE`) or at run time
//! (`POST /admin/outage`); the admin routes keep working. Each refused call is counted
//! (`provider_outage_refused_total`), so a drill measures how hard callers knocked.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

/// An outage: the status every call gets, and the `Retry-After` it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    /// 503 or 429.
    pub status: u16,
    pub retry_after_secs: u32,
}

/// `off`, `503`, `429`, or either with `:<Retry-After seconds>` (default 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutageSetting(pub Option<Outage>);

/// Why an outage setting was refused.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid outage {0:?}: use off, 503 or 429, optionally with :<Retry-After seconds 0-3600> (503:5)"
)]
pub struct OutageSyntaxError(String);

impl FromStr for OutageSetting {
    type Err = OutageSyntaxError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() || s == "off" {
            return Ok(Self(None));
        }
        let bad = || OutageSyntaxError(s.to_string());
        let (status, retry) = s.split_once(':').unwrap_or((s, "1"));
        let status: u16 = status.parse().map_err(|_| bad())?;
        let retry_after_secs: u32 = retry.parse().map_err(|_| bad())?;
        if !matches!(status, 429 | 503) || retry_after_secs > 3600 {
            return Err(bad());
        }
        Ok(Self(Some(Outage {
            status,
            retry_after_secs,
        })))
    }
}

impl fmt::Display for OutageSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => f.write_str("off"),
            Some(o) => write!(f, "{}:{}", o.status, o.retry_after_secs),
        }
    }
}

/// The switch, shared by the server's tasks.
#[derive(Debug, Default)]
pub struct OutageSwitch(Mutex<OutageSetting>);

impl OutageSwitch {
    pub fn new(setting: OutageSetting) -> Self {
        Self(Mutex::new(setting))
    }
    pub fn get(&self) -> OutageSetting {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub fn set(&self, setting: OutageSetting) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = setting;
    }
}

/// The middleware on the API's routes: refuses the call while the switch is on.
pub async fn refuse_while_down(
    State(switch): State<std::sync::Arc<OutageSwitch>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(o) = switch.get().0 else {
        return next.run(request).await;
    };
    crate::internal_events::outage_refused(o.status);
    let status = StatusCode::from_u16(o.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let mut response = (
        status,
        Json(
            serde_json::json!({ "error": "the provider is down (outage drill); nothing was done" }),
        ),
    )
        .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(o.retry_after_secs));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_print_back_and_nonsense_is_refused() {
        for s in ["off", "503:1", "429:30", "503:0"] {
            assert_eq!(s.parse::<OutageSetting>().unwrap().to_string(), s);
        }
        assert_eq!("503".parse::<OutageSetting>().unwrap().to_string(), "503:1");
        assert_eq!("".parse::<OutageSetting>().unwrap(), OutageSetting(None));
        for bad in ["500", "503:x", "429:9999", "down"] {
            assert!(bad.parse::<OutageSetting>().is_err(), "{bad}");
        }
    }
}
