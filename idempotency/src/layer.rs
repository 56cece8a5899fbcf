//! [`IdempotencyLayer`]: the tower layer a service puts on its own routes. For every request:
//!
//! 1. the `Idempotency-Key` (400 if missing or malformed), the scope from the service's own auth
//!    (401 if none), the body (413 over the route's `DefaultBodyLimit`) and the fingerprint of the
//!    validated request (the service's [`IdempotencyLayer::fingerprint`] may answer 4xx itself;
//!    nothing is stored for any of these);
//! 2. the reservation, before any effect: a replay, 409 + `Retry-After` or 422 answer here;
//! 3. the handler, with an [`crate::Effect`] in its extensions (its transaction);
//! 4. a response the layer stores (2xx, definitive 4xx): the record is completed in the effect's
//!    transaction, fenced by the token, and committed with the handler's rows; any other response,
//!    an error or a panic: rolled back and the key released, awaited before the response leaves.

use crate::effect::{Effect, EffectShared, Pending, ResourceId};
use crate::error::IdempotencyError;
use crate::fingerprint::{Fingerprints, Target};
use crate::internal_events::{self, Outcome, ReleaseReason};
use crate::key::{KeyHash, key_from_headers};
use crate::persistence::{self, Owned, RecordKey, RecordStatus, Reservation, StoredResponse};
use crate::release::ReleaseGuard;
use crate::replay::replay;
use crate::store::Idempotency;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll};
use tokio::sync::Mutex;
use uuid::Uuid;

type ScopeFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;
type FingerprintFn = Arc<dyn Fn(&mut Parts, &Bytes) -> Result<Value, Box<Response>> + Send + Sync>;
type LocationFn = Arc<dyn Fn(Uuid) -> String + Send + Sync>;
type BodyFn = Arc<dyn Fn(&str) -> String + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub store: Idempotency,
    pub operation: Arc<str>,
    pub scope: Option<ScopeFn>,
    pub fingerprint: Option<FingerprintFn>,
    pub location: Option<LocationFn>,
    pub replay_body: Option<BodyFn>,
    pub stored: fn(StatusCode) -> bool,
}

impl Config {
    pub(crate) fn location_of(&self, id: Option<Uuid>) -> Option<HeaderValue> {
        let (Some(location), Some(id)) = (&self.location, id) else {
            return None;
        };
        HeaderValue::from_str(&location(id)).ok()
    }
}

/// Which responses are stored and replayed by default: every 2xx, and the 4xx that are definitive
/// answers to the request. Not stored (the key is released, a retry runs anew): 5xx, 3xx, the 4xx
/// that depend on the moment rather than the request (401, 403, 407, 408, 409, 423, 425, 429), and
/// those about the request's form in headers the fingerprint does not cover, which a corrected
/// retry with the same key must be able to fix (405 method, 406 `Accept`, 412 and 428
/// preconditions, 415 `Content-Type`).
pub fn stored_by_default(status: StatusCode) -> bool {
    status.is_success()
        || (status.is_client_error()
            && !matches!(
                status.as_u16(),
                401 | 403 | 405 | 406 | 407 | 408 | 409 | 412 | 415 | 423 | 425 | 428 | 429
            ))
}

/// Longest scope stored with a record: a longer one (or an empty one) is no usable principal.
pub const MAX_SCOPE_LEN: usize = 512;

impl Idempotency {
    /// The layer that makes the routes it wraps idempotent as `operation` (e.g. `create_refund`):
    /// with the scope, the key names one record per operation.
    ///
    /// # Panics
    /// When `operation` is empty or over 200 bytes: a programming error, found at start-up rather
    /// than as a 500 on every request.
    pub fn route(&self, operation: &str) -> IdempotencyLayer {
        assert!(
            (1..=200).contains(&operation.len()),
            "an idempotent operation's name must be 1 to 200 bytes, got {operation:?}"
        );
        IdempotencyLayer::new(self.clone(), operation)
    }
}

/// Makes the routes it wraps idempotent as one operation; build it with [`Idempotency::route`].
/// Put it on a route (`post(handler).route_layer(..)`) or a router (`Router::route_layer(..)`)
/// behind the service's authentication: `route_layer`, so that a request with another method
/// gets the route's 405, not the layer's demand for a key.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("operation", &self.config.operation)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    pub(crate) fn new(store: Idempotency, operation: &str) -> Self {
        Self {
            config: Arc::new(Config {
                store,
                operation: operation.into(),
                scope: None,
                fingerprint: None,
                location: None,
                replay_body: None,
                stored: stored_by_default,
            }),
        }
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        // Built before it is shared; a clone made earlier keeps its own settings.
        change(Arc::make_mut(&mut self.config));
        self
    }

    /// Whose key it is, from the request as the service's own authentication left it (typically a
    /// request extension it inserted: tenant, account, principal). `None` answers 401. Required:
    /// without it every request gets 401, so keys never leak across principals.
    pub fn scope(self, scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.with(|c| c.scope = Some(Arc::new(scope)))
    }

    /// Validates the body and returns the normalized request the fingerprint is taken over
    /// (canonical JSON of it and the operation). It may answer a 4xx itself (nothing is stored)
    /// and may put the validated request into `parts.extensions` for the handler. Default: the
    /// body as JSON (400 if it is not).
    pub fn fingerprint<E: IntoResponse>(
        self,
        f: impl Fn(&mut Parts, &Bytes) -> Result<Value, E> + Send + Sync + 'static,
    ) -> Self {
        self.with(|c| {
            c.fingerprint = Some(Arc::new(move |parts: &mut Parts, bytes: &Bytes| {
                f(parts, bytes).map_err(|e| Box::new(e.into_response()))
            }))
        })
    }

    /// The fingerprint of a JSON body deserialized as `T`: 400 if it is not JSON, 422 if it is not
    /// a `T` (both `{"error": ...}`, nothing stored). The fingerprint is taken over `T` serialized
    /// again (so key order and anything `T` does not keep do not matter); the handler gets the `T`
    /// as `Extension<T>`.
    pub fn json<T>(self) -> Self
    where
        T: serde::de::DeserializeOwned + serde::Serialize + Clone + Send + Sync + 'static,
    {
        self.fingerprint(|parts, bytes| {
            let request: T = serde_json::from_slice(bytes).map_err(|e| {
                if e.is_data() {
                    IdempotencyError::InvalidRequest(e.to_string())
                } else {
                    IdempotencyError::InvalidJson
                }
            })?;
            let normalized = serde_json::to_value(&request)
                .map_err(|e| IdempotencyError::Internal(format!("serializing the request: {e}")))?;
            parts.extensions.insert(request);
            Ok::<_, IdempotencyError>(normalized)
        })
    }

    /// The `Location` of a created resource (see [`ResourceId`]), set on 2xx responses and replays.
    pub fn location(self, f: impl Fn(Uuid) -> String + Send + Sync + 'static) -> Self {
        self.with(|c| c.location = Some(Arc::new(f)))
    }

    /// Transforms stored bodies when replaying them (default: byte-identical).
    pub fn replay_body(self, f: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.with(|c| c.replay_body = Some(Arc::new(f)))
    }

    /// Which responses are stored and replayed (default [`stored_by_default`]); the others release
    /// the key. Only 2xx and 4xx can be stored: 1xx, 3xx and 5xx always release it.
    pub fn stored(self, f: fn(StatusCode) -> bool) -> Self {
        self.with(|c| c.stored = f)
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            config: self.config.clone(),
            inner,
        }
    }
}

/// The service [`IdempotencyLayer`] wraps a route in.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    config: Arc<Config>,
    inner: S,
}

impl<S> tower_service::Service<Request> for IdempotencyService<S>
where
    S: tower_service::Service<Request, Response = Response, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The clone is ready only if `self.inner` was polled; take the ready one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(async move { Ok(handle(config, inner, request).await) })
    }
}

async fn handle<S>(config: Arc<Config>, mut inner: S, request: Request) -> Response
where
    S: tower_service::Service<Request, Response = Response, Error = Infallible>,
{
    let operation = config.operation.clone();
    let (mut parts, body) = request.into_parts();
    let (key, scope, bytes, fingerprints) = match read_request(&config, &mut parts, body).await {
        Ok(read) => read,
        Err(response) => return response,
    };
    let store = &config.store;
    let now = store.now();
    let record = RecordKey {
        schema: store.schema.clone(),
        scope,
        operation: operation.clone(),
        key,
    };
    // Armed before reserving: if this request is dropped while the reservation is in flight, the
    // token-fenced delete removes whatever it reserved (and nothing else), once it has settled.
    let token = Uuid::new_v4();
    let guard = ReleaseGuard::new(store.pool.clone(), record.clone(), token);
    let (outcome, guard) = match reserve(&config, &record, fingerprints, token, now, guard).await {
        Ok(reserved) => reserved,
        Err(response) => return response,
    };
    internal_events::idempotency_outcome(&operation, outcome);
    tracing::debug!(key = %key.log_id(), scope = %record.scope, operation = %operation,
        outcome = outcome.as_str(), "key reserved");

    let shared = Arc::new(EffectShared {
        pool: store.pool.clone(),
        record,
        token,
        now,
        tx: Mutex::new(None),
        superseded: AtomicBool::new(false),
    });
    parts.extensions.insert(Effect {
        shared: shared.clone(),
    });
    let request = Request::from_parts(parts, Body::from(bytes));
    let response = match AssertUnwindSafe(inner.call(request)).catch_unwind().await {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(panic) => {
            rollback(&shared).await;
            guard.release(ReleaseReason::Panic).await;
            return IdempotencyError::Panicked(panic_message(panic.as_ref())).into_response();
        }
    };
    finish(&config, &shared, guard, response).await
}

/// What the layer needs of a request before it reserves the key: the key, the caller's scope,
/// the body (under the route's limit) and the request's fingerprints; or the answer that refuses
/// it.
async fn read_request(
    config: &Config,
    parts: &mut Parts,
    body: Body,
) -> Result<(KeyHash, String, Bytes, Fingerprints), Response> {
    let key = key_from_headers(&parts.headers).map_err(IntoResponse::into_response)?;
    let Some(scope) = config.scope.as_ref().and_then(|f| f(parts)) else {
        return Err(IdempotencyError::Unauthenticated.into_response());
    };
    if scope.is_empty() || scope.len() > MAX_SCOPE_LEN {
        tracing::warn!(
            operation = %config.operation,
            scope_len = scope.len(),
            "the scope function returned an empty or over-long scope; answering 401"
        );
        return Err(IdempotencyError::Unauthenticated.into_response());
    }
    // The body under the route's DefaultBodyLimit (it travels in the extensions).
    let mut body_request = Request::new(body);
    *body_request.extensions_mut() = parts.extensions.clone();
    let bytes = match Bytes::from_request(body_request, &()).await {
        Ok(bytes) => bytes,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return Err(IdempotencyError::PayloadTooLarge.into_response());
        }
        Err(rejection) => {
            tracing::debug!(%rejection, "cannot read request body");
            return Err(IdempotencyError::BodyUnreadable.into_response());
        }
    };
    let normalized = match &config.fingerprint {
        Some(f) => f(parts, &bytes).map_err(|response| *response)?,
        None => serde_json::from_slice::<Value>(&bytes)
            .map_err(|_| IdempotencyError::InvalidJson.into_response())?,
    };
    let target = Target {
        method: parts.method.as_str(),
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |p| p.as_str()),
    };
    let fingerprints = Fingerprints::of(&config.operation, target, &normalized);
    Ok((key, scope, bytes, fingerprints))
}

/// Reserves the key (in a task of its own, which `guard` releases after if this request is
/// dropped): how this request came to own it, with the guard still armed, or the answer when it
/// does not (a replay, a conflict, a mismatch, an error).
async fn reserve(
    config: &Config,
    record: &RecordKey,
    fingerprints: Fingerprints,
    token: Uuid,
    now: chrono::DateTime<chrono::Utc>,
    mut guard: ReleaseGuard,
) -> Result<(Outcome, ReleaseGuard), Response> {
    let operation = &config.operation;
    let reserving = {
        let (store, record) = (config.store.clone(), record.clone());
        async move { persistence::reserve(&store, &record, &fingerprints, token, now).await }
    };
    let reservation = match guard.reserve(reserving).await {
        Ok(Ok(reservation)) => reservation,
        Ok(Err(e)) => {
            guard.release(ReleaseReason::Error).await;
            return Err(IdempotencyError::from(e).into_response());
        }
        Err(e) => {
            guard.release(ReleaseReason::Error).await;
            let e = IdempotencyError::Internal(format!("reservation task: {e}"));
            return Err(e.into_response());
        }
    };
    let refused = match reservation {
        Reservation::Replay(stored) => {
            guard.disarm();
            internal_events::idempotency_outcome(operation, Outcome::Replayed);
            replay(
                &stored,
                config.replay_body.as_deref(),
                config.location_of(stored.resource_id),
            )
        }
        Reservation::InFlight => {
            guard.disarm();
            internal_events::idempotency_outcome(operation, Outcome::Conflict);
            IdempotencyError::InFlight.into_response()
        }
        Reservation::Mismatch => {
            guard.disarm();
            internal_events::idempotency_outcome(operation, Outcome::Mismatch);
            IdempotencyError::KeyReused.into_response()
        }
        Reservation::Owned(Owned::New) => return Ok((Outcome::New, guard)),
        Reservation::Owned(Owned::Expired) => return Ok((Outcome::Expired, guard)),
        Reservation::Owned(Owned::TakenOver) => return Ok((Outcome::TakenOver, guard)),
    };
    Err(refused)
}

/// After the handler: store its response with the effect, or release the key.
async fn finish(
    config: &Config,
    shared: &EffectShared,
    mut guard: ReleaseGuard,
    response: Response,
) -> Response {
    if shared.is_superseded() {
        return superseded(config, shared, guard).await;
    }
    let status = response.status();
    let storable = status.is_success() || status.is_client_error();
    if !(storable && (config.stored)(status)) {
        rollback(shared).await;
        guard.release(ReleaseReason::Error).await;
        return response;
    }
    let (mut parts, record_status, stored) = match to_record(response).await {
        Ok(r) => r,
        Err(e) => return fail(shared, guard, e).await,
    };
    match commit_record(shared, record_status, &stored).await {
        Ok(()) => {}
        Err(Unstored::Superseded) => return superseded(config, shared, guard).await,
        Err(Unstored::Failed(e)) => return fail(shared, guard, e).await,
    }
    guard.disarm();
    if status.is_success()
        && !parts.headers.contains_key(header::LOCATION)
        && let Some(location) = config.location_of(stored.resource_id)
    {
        parts.headers.insert(header::LOCATION, location);
    }
    Response::from_parts(parts, Body::from(stored.body))
}

/// The handler's response as the record keeps it: its parts (to answer with), the record's
/// status and the stored response. A body that cannot be read or is not UTF-8, or a pending
/// answer without the resource it is pending for, cannot be stored.
async fn to_record(
    response: Response,
) -> Result<(axum::http::response::Parts, RecordStatus, StoredResponse), IdempotencyError> {
    let status = response.status();
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|e| IdempotencyError::Internal(format!("response body: {e}")))?;
    let Ok(body) = String::from_utf8(body.to_vec()) else {
        return Err(IdempotencyError::Internal(
            "response body is not UTF-8".into(),
        ));
    };
    let resource_id = parts.extensions.get::<ResourceId>().map(|r| r.0);
    let record_status = match (status.is_success(), parts.extensions.get::<Pending>()) {
        (false, _) => RecordStatus::Failed,
        (true, None) => RecordStatus::Completed,
        (true, Some(_)) if resource_id.is_some() => RecordStatus::Pending,
        (true, Some(_)) => {
            return Err(IdempotencyError::Internal(
                "Pending without a ResourceId".into(),
            ));
        }
    };
    let stored = StoredResponse {
        status: status.as_u16(),
        body,
        resource_id,
    };
    Ok((parts, record_status, stored))
}

/// Why the response was not stored with the effect.
enum Unstored {
    /// A retry took the lease over.
    Superseded,
    Failed(IdempotencyError),
}

/// Stores the response in the effect's transaction, fenced by the lease token, and commits both.
async fn commit_record(
    shared: &EffectShared,
    record_status: RecordStatus,
    stored: &StoredResponse,
) -> Result<(), Unstored> {
    let mut slot = shared.tx.lock().await;
    if let Err(e) = shared.begin(&mut slot).await {
        drop(slot);
        if shared.is_superseded() {
            return Err(Unstored::Superseded);
        }
        return Err(Unstored::Failed(e));
    }
    let Some(mut tx) = slot.take() else {
        drop(slot);
        return Err(Unstored::Failed(IdempotencyError::Internal(
            "effect transaction missing".into(),
        )));
    };
    drop(slot);
    let completed = persistence::complete(
        &mut tx,
        &shared.record,
        shared.token,
        record_status,
        stored,
        shared.now,
    )
    .await;
    match completed {
        Ok(true) => {}
        Ok(false) => {
            rollback_tx(tx).await;
            return Err(Unstored::Superseded);
        }
        Err(e) => {
            rollback_tx(tx).await;
            return Err(Unstored::Failed(e.into()));
        }
    }
    // On an error perhaps committed after all: the fenced release then finds nothing to delete.
    tx.commit().await.map_err(|e| Unstored::Failed(e.into()))
}

/// The layer failed around the effect: roll back, release the key, answer with the error.
async fn fail(shared: &EffectShared, guard: ReleaseGuard, e: IdempotencyError) -> Response {
    rollback(shared).await;
    guard.release(ReleaseReason::Error).await;
    e.into_response()
}

/// A retry took our lease over: roll back, leave the key to its new holder, answer 409.
async fn superseded(config: &Config, shared: &EffectShared, mut guard: ReleaseGuard) -> Response {
    rollback(shared).await;
    guard.disarm();
    internal_events::idempotency_outcome(&config.operation, Outcome::Conflict);
    IdempotencyError::Superseded.into_response()
}

/// Rolls the effect's transaction back, if it was begun (before any release: it holds the record's
/// row lock).
async fn rollback(shared: &EffectShared) {
    let tx = shared.tx.lock().await.take();
    if let Some(tx) = tx {
        rollback_tx(tx).await;
    }
}

async fn rollback_tx(tx: sqlx::Transaction<'static, sqlx::Postgres>) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %crate::error::ErrorChain(&e), "rolling back the effect failed");
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
