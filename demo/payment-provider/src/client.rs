//! The typed client of the provider, for the payment process. Every failure is classified by
//! what it means for the money:
//!
//! | what happened | [`ChargeError`] | charged? |
//! |---|---|---|
//! | 402 | `Declined` | no, and never will be for this request: permanent |
//! | 503, 429, connection refused / not established | `Unavailable` | no: retry later |
//! | timeout after the request was sent, connection reset or closed before the answer, other 5xx, unreadable 2xx body | `OutcomeUnknown` | maybe: retry with the same key, or query by reference |
//! | other 4xx (400, 404, 409, 422 key mismatch); a request that cannot be built | `Invalid` | no: the request is wrong, do not retry it |
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use payment_provider::client::{ChargeError, Client};
//! use std::time::Duration;
//! let provider = Client::new("http://127.0.0.1:8090", Duration::from_secs(5))?;
//! match provider.charge("payment-42", 1999, "EUR", Some("payment-42/charge")).await {
//!     Ok(charge) => println!("charged: {}", charge.id),
//!     Err(ChargeError::OutcomeUnknown { .. }) => {
//!         let found = provider.find_by_reference("payment-42").await?;
//!         println!("after an unknown outcome: {found:?}");
//!     }
//!     Err(e) => println!("{e}"),
//! }
//! # Ok(()) }
//! ```

use crate::api::{
    Charge, ChargeRequest, ChargeStatus, EventRecord, FaultsBody, IDEMPOTENCY_KEY_HEADER, ModeBody,
    Refund, RefundRequest,
};
use crate::mode::ConfirmationMode;
use reqwest::StatusCode;
use std::time::Duration;
use uuid::Uuid;

/// Connection attempts give up after this long (or the request timeout, if shorter).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot build the HTTP client")]
pub struct BuildError(#[source] reqwest::Error);

/// Why a charge did not (knowingly) succeed.
#[derive(Debug, thiserror::Error)]
pub enum ChargeError {
    /// Definitive: the provider refused (402). Nothing was charged; retrying will not help.
    #[error("the provider declined the charge: {message}")]
    Declined {
        message: String,
        /// The declined charge's id, when the provider said (its `Location`).
        charge_id: Option<Uuid>,
    },
    /// Transient, and nothing was charged: 503/429, or the request never reached the provider.
    #[error("the provider is unavailable, nothing was charged: {reason}")]
    Unavailable {
        reason: String,
        #[source]
        source: Option<reqwest::Error>,
        /// The provider's `Retry-After`, if it said.
        retry_after: Option<Duration>,
    },
    /// The request was sent and no usable answer came back: the charge may or may not exist.
    #[error("the outcome of the charge is unknown: {reason}")]
    OutcomeUnknown {
        reason: String,
        #[source]
        source: Option<reqwest::Error>,
    },
    /// The provider refused the request itself (4xx), or it could not even be built (`status`
    /// 0, e.g. a key that is not a valid header value): it must not be retried as it is.
    #[error("the provider refused the request ({status}): {message}")]
    Invalid { status: u16, message: String },
}

impl ChargeError {
    /// Whether retrying (with the same idempotency key) may help.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ChargeError::Unavailable { .. } | ChargeError::OutcomeUnknown { .. }
        )
    }
}

/// Why a lookup failed. Lookups change nothing, so any failure but the first two may be retried.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The provider does not support this lookup (PROVIDER_STATUS_QUERY=off: 501 or 404).
    #[error("the provider does not support looking charges up by reference")]
    QueryUnsupported,
    /// The provider refused the request (4xx other than 429).
    #[error("the provider refused the lookup ({status}): {message}")]
    Invalid { status: u16, message: String },
    /// No usable answer (transport failure, timeout, 5xx, 429, unreadable body). A 429 is the
    /// provider asking to be called later, as for a charge, not a refusal of the lookup.
    #[error("the lookup failed: {reason}")]
    Unavailable {
        reason: String,
        #[source]
        source: Option<reqwest::Error>,
    },
}

/// Why a refund did not (knowingly) happen.
#[derive(Debug, thiserror::Error)]
pub enum RefundError {
    #[error("no such charge")]
    NotFound,
    /// The charge cannot be refunded (it was declined): permanent.
    #[error("the charge cannot be refunded: {message}")]
    NotRefundable { message: String },
    /// Nothing was refunded; retry later.
    #[error("the provider is unavailable, nothing was refunded: {reason}")]
    Unavailable {
        reason: String,
        #[source]
        source: Option<reqwest::Error>,
        /// The provider's `Retry-After`, if it said.
        retry_after: Option<Duration>,
    },
    /// The request was sent and no usable answer came back. A refund is once per charge, so
    /// retrying is safe.
    #[error("the outcome of the refund is unknown: {reason}")]
    OutcomeUnknown {
        reason: String,
        #[source]
        source: Option<reqwest::Error>,
    },
    #[error("the provider refused the request ({status}): {message}")]
    Invalid { status: u16, message: String },
}

/// Why a notification was not (knowingly) accepted.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// 503/429 or no connection: nothing was done.
    #[error("the notification service is unavailable: {reason}")]
    Unavailable {
        reason: String,
        retry_after: Option<Duration>,
    },
    /// Sent, no usable answer: posting again with the same key is safe.
    #[error("the outcome of the notification is unknown: {0}")]
    OutcomeUnknown(String),
    /// Refused (4xx): posting it again will not help.
    #[error("the notification was refused ({status}): {message}")]
    Invalid { status: u16, message: String },
}

/// A client of one provider.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
}

/// A transport failure: was the request possibly received?
enum Transport {
    /// The connection was never established: the provider saw nothing.
    NotSent(reqwest::Error),
    /// Sent (or possibly sent), then no answer.
    Unknown(reqwest::Error),
}

fn transport(e: reqwest::Error) -> Transport {
    if e.is_connect() || e.is_builder() {
        Transport::NotSent(e)
    } else {
        Transport::Unknown(e)
    }
}

/// How each call's error names the failures every call classifies alike.
struct Failures<E> {
    /// Nothing was done; retrying later may help.
    unavailable: fn(String, Option<reqwest::Error>) -> E,
    /// Sent, and no usable answer came back: it may or may not have been done.
    outcome_unknown: fn(String, Option<reqwest::Error>) -> E,
    /// The provider refused the request itself (4xx).
    invalid: fn(u16, String) -> E,
}

const CHARGE: Failures<ChargeError> = Failures {
    unavailable: |reason, source| ChargeError::Unavailable {
        reason,
        source,
        retry_after: None,
    },
    outcome_unknown: |reason, source| ChargeError::OutcomeUnknown { reason, source },
    invalid: |status, message| ChargeError::Invalid { status, message },
};

const REFUND: Failures<RefundError> = Failures {
    unavailable: |reason, source| RefundError::Unavailable {
        reason,
        source,
        retry_after: None,
    },
    outcome_unknown: |reason, source| RefundError::OutcomeUnknown { reason, source },
    invalid: |status, message| RefundError::Invalid { status, message },
};

/// A lookup changes nothing, so an unknown outcome is just no answer.
const QUERY: Failures<QueryError> = Failures {
    unavailable: |reason, source| QueryError::Unavailable { reason, source },
    outcome_unknown: |reason, source| QueryError::Unavailable { reason, source },
    invalid: |status, message| QueryError::Invalid { status, message },
};

impl<E> Failures<E> {
    /// The body of a success answer; one that cannot be read leaves the outcome unknown.
    async fn body<T: serde::de::DeserializeOwned>(
        &self,
        response: reqwest::Response,
    ) -> Result<T, E> {
        let status = response.status();
        response.json::<T>().await.map_err(|e| {
            (self.outcome_unknown)(format!("the {status} answer could not be read"), Some(e))
        })
    }

    /// A failure answer that the call has no meaning of its own for: 503/429 is unavailable,
    /// other 4xx invalid, anything else (5xx) an unknown outcome.
    fn refused(&self, status: StatusCode, message: String) -> E {
        match status {
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS => {
                (self.unavailable)(format!("{status}: {message}"), None)
            }
            s if s.is_client_error() => (self.invalid)(s.as_u16(), message),
            s => (self.outcome_unknown)(format!("{s}: {message}"), None),
        }
    }
}

/// The answer's `Retry-After` in seconds (the HTTP-date form is not used by this provider and
/// read as none), at most an hour.
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let secs: u64 = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(secs.min(3600)))
}

/// `{"error": "..."}` or the raw body.
async fn message(response: reqwest::Response) -> String {
    let text = response.text().await.unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or(text)
}

impl Client {
    /// `base_url` like `http://127.0.0.1:8090`; `timeout` bounds every request from start to
    /// the end of the answer.
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, BuildError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(CONNECT_TIMEOUT))
            .build()
            .map_err(BuildError)?;
        Ok(Self {
            http,
            base: base_url.trim_end_matches('/').to_string(),
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Charges `amount` minor units of `currency` for `reference`. With a key, repeating the
    /// call (after any error) never charges twice.
    pub async fn charge(
        &self,
        reference: &str,
        amount: i64,
        currency: &str,
        idempotency_key: Option<&str>,
    ) -> Result<Charge, ChargeError> {
        let mut request = self.http.post(self.url("/charges")).json(&ChargeRequest {
            amount,
            currency: currency.to_string(),
            reference: reference.to_string(),
        });
        if let Some(key) = idempotency_key {
            request = request.header(IDEMPOTENCY_KEY_HEADER, key);
        }
        let response = request.send().await.map_err(|e| match transport(e) {
            Transport::NotSent(e) if e.is_builder() => ChargeError::Invalid {
                status: 0,
                message: format!("the request cannot be built: {e}"),
            },
            Transport::NotSent(e) => ChargeError::Unavailable {
                reason: "cannot connect".into(),
                source: Some(e),
                retry_after: None,
            },
            Transport::Unknown(e) => ChargeError::OutcomeUnknown {
                reason: if e.is_timeout() {
                    "timed out waiting for the answer".into()
                } else {
                    "the connection failed before the answer".into()
                },
                source: Some(e),
            },
        })?;
        let status = response.status();
        if status.is_success() {
            return CHARGE.body(response).await;
        }
        let charge_id = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|l| l.rsplit('/').next())
            .and_then(|id| Uuid::parse_str(id).ok());
        let wait = retry_after(&response);
        let message = message(response).await;
        Err(match status {
            StatusCode::PAYMENT_REQUIRED => ChargeError::Declined { message, charge_id },
            s => match CHARGE.refused(s, message) {
                ChargeError::Unavailable { reason, source, .. } => ChargeError::Unavailable {
                    reason,
                    source,
                    retry_after: wait,
                },
                e => e,
            },
        })
    }

    /// The charge with this id, `None` if the provider has none.
    pub async fn get_charge(&self, id: Uuid) -> Result<Option<Charge>, QueryError> {
        let response = self
            .query(self.http.get(self.url(&format!("/charges/{id}"))))
            .await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        Self::read(response).await.map(Some)
    }

    /// Every charge of `reference`, oldest first.
    pub async fn charges_by_reference(&self, reference: &str) -> Result<Vec<Charge>, QueryError> {
        let response = self
            .query(
                self.http
                    .get(self.url("/charges"))
                    .query(&[("reference", reference)]),
            )
            .await?;
        if matches!(
            response.status(),
            StatusCode::NOT_IMPLEMENTED | StatusCode::NOT_FOUND
        ) {
            return Err(QueryError::QueryUnsupported);
        }
        Self::read(response).await
    }

    /// The charge that settles `reference`: the first that took money (succeeded or refunded) or
    /// may still take it (`pending`, async mode: not decided yet), else the latest declined one;
    /// `None` if the provider never charged it.
    pub async fn find_by_reference(&self, reference: &str) -> Result<Option<Charge>, QueryError> {
        let charges = self.charges_by_reference(reference).await?;
        let taken = charges
            .iter()
            .find(|c| c.status != ChargeStatus::Declined)
            .cloned();
        Ok(taken.or_else(|| charges.last().cloned()))
    }

    /// Refunds the whole charge. Repeating it answers the first refund.
    pub async fn refund(&self, charge_id: Uuid) -> Result<Refund, RefundError> {
        let response = self
            .http
            .post(self.url("/refunds"))
            .json(&RefundRequest { charge_id })
            .send()
            .await
            .map_err(|e| match transport(e) {
                Transport::NotSent(e) => RefundError::Unavailable {
                    reason: "cannot connect".into(),
                    source: Some(e),
                    retry_after: None,
                },
                Transport::Unknown(e) => RefundError::OutcomeUnknown {
                    reason: "no answer".into(),
                    source: Some(e),
                },
            })?;
        let status = response.status();
        if status.is_success() {
            return REFUND.body(response).await;
        }
        let wait = retry_after(&response);
        let message = message(response).await;
        Err(match status {
            StatusCode::NOT_FOUND => RefundError::NotFound,
            StatusCode::CONFLICT => RefundError::NotRefundable { message },
            s => match REFUND.refused(s, message) {
                RefundError::Unavailable { reason, source, .. } => RefundError::Unavailable {
                    reason,
                    source,
                    retry_after: wait,
                },
                e => e,
            },
        })
    }

    /// Posts a notification once per `idempotency_key` (`POST /notifications`): the number of
    /// times the key has been posted, 1 the first time.
    pub async fn notify(
        &self,
        idempotency_key: &str,
        body: &serde_json::Value,
    ) -> Result<i32, NotifyError> {
        let response = self
            .http
            .post(self.url("/notifications"))
            .header(IDEMPOTENCY_KEY_HEADER, idempotency_key)
            .json(body)
            .send()
            .await
            .map_err(|e| match transport(e) {
                Transport::NotSent(e) => NotifyError::Unavailable {
                    reason: format!("cannot connect: {e}"),
                    retry_after: None,
                },
                Transport::Unknown(e) => NotifyError::OutcomeUnknown(e.to_string()),
            })?;
        let status = response.status();
        let wait = retry_after(&response);
        if status.is_success() {
            let n: crate::notifications::Notified = response
                .json()
                .await
                .map_err(|e| NotifyError::OutcomeUnknown(format!("unreadable answer: {e}")))?;
            return Ok(n.posts);
        }
        let message = message(response).await;
        Err(match status {
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS => {
                NotifyError::Unavailable {
                    reason: format!("{status}: {message}"),
                    retry_after: wait,
                }
            }
            s if s.is_client_error() => NotifyError::Invalid {
                status: s.as_u16(),
                message,
            },
            s => NotifyError::OutcomeUnknown(format!("{s}: {message}")),
        })
    }

    /// Every charge (`GET /admin/charges`), for verification.
    pub async fn admin_charges(&self) -> Result<Vec<Charge>, QueryError> {
        let response = self
            .query(self.http.get(self.url("/admin/charges")))
            .await?;
        Self::read(response).await
    }

    /// Replaces the injected faults (`mode:percent,...`; empty clears); answers the new set.
    pub async fn set_faults(&self, faults: &str) -> Result<String, QueryError> {
        let response = self
            .query(self.http.post(self.url("/admin/faults")).json(&FaultsBody {
                faults: faults.to_string(),
            }))
            .await?;
        Self::read::<FaultsBody>(response).await.map(|b| b.faults)
    }

    /// Switches between sync and async confirmation (`POST /admin/mode`); answers the new mode.
    pub async fn set_mode(&self, mode: ConfirmationMode) -> Result<ConfirmationMode, QueryError> {
        let response = self
            .query(
                self.http
                    .post(self.url("/admin/mode"))
                    .json(&ModeBody { mode }),
            )
            .await?;
        Self::read::<ModeBody>(response).await.map(|b| b.mode)
    }

    /// The webhook events (`GET /admin/events`), of one charge if given, oldest first.
    pub async fn admin_events(
        &self,
        charge_id: Option<Uuid>,
    ) -> Result<Vec<EventRecord>, QueryError> {
        let mut request = self.http.get(self.url("/admin/events"));
        if let Some(id) = charge_id {
            request = request.query(&[("charge_id", id.to_string())]);
        }
        let response = self.query(request).await?;
        Self::read(response).await
    }

    async fn query(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, QueryError> {
        request.send().await.map_err(|e| QueryError::Unavailable {
            reason: "no answer".into(),
            source: Some(e),
        })
    }

    async fn read<T: serde::de::DeserializeOwned>(
        response: reqwest::Response,
    ) -> Result<T, QueryError> {
        let status = response.status();
        if status.is_success() {
            return QUERY.body(response).await;
        }
        let message = message(response).await;
        Err(QUERY.refused(status, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every call reads a failure answer alike, except what an unknown outcome means: a lookup
    /// changes nothing, so for it an unknown outcome is just no answer.
    #[test]
    fn failure_answers_are_classified_per_call() {
        let m = || "m".to_string();
        for status in [
            StatusCode::SERVICE_UNAVAILABLE,
            StatusCode::TOO_MANY_REQUESTS,
        ] {
            assert!(matches!(
                CHARGE.refused(status, m()),
                ChargeError::Unavailable { .. }
            ));
            assert!(matches!(
                REFUND.refused(status, m()),
                RefundError::Unavailable { .. }
            ));
            assert!(matches!(
                QUERY.refused(status, m()),
                QueryError::Unavailable { .. }
            ));
        }
        for status in [
            StatusCode::BAD_REQUEST,
            StatusCode::CONFLICT,
            StatusCode::UNPROCESSABLE_ENTITY,
        ] {
            let code = status.as_u16();
            assert!(
                matches!(CHARGE.refused(status, m()), ChargeError::Invalid { status, .. } if status == code)
            );
            assert!(
                matches!(REFUND.refused(status, m()), RefundError::Invalid { status, .. } if status == code)
            );
            assert!(
                matches!(QUERY.refused(status, m()), QueryError::Invalid { status, .. } if status == code)
            );
        }
        for status in [StatusCode::INTERNAL_SERVER_ERROR, StatusCode::BAD_GATEWAY] {
            assert!(matches!(
                CHARGE.refused(status, m()),
                ChargeError::OutcomeUnknown { .. }
            ));
            assert!(matches!(
                REFUND.refused(status, m()),
                RefundError::OutcomeUnknown { .. }
            ));
            assert!(matches!(
                QUERY.refused(status, m()),
                QueryError::Unavailable { .. }
            ));
        }
    }
}
