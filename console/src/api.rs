//! The JSON API under `/api`, for bearer tokens (`Authorization: Bearer ct_...`). Every response
//! is redacted; every error is `{"error": "..."}`. The web page's forms are forwarded to the same
//! action routes ([`forward`]), so both go through one path: authentication, the Idempotency-Key
//! ([`crate::keys`]), the role check and the action.

use crate::actions::{self, Outcome};
use crate::approvals::{self, Decision};
use crate::audit;
use crate::commands;
use crate::dead_letters;
use crate::error::ConsoleError;
use crate::keys::{self, Keyed};
use crate::ordered::{self, OrderedAction};
use crate::outbox_dead;
use crate::processes::{ProcessActionRequest, ProcessFilter};
use crate::redact;
use crate::roles::Action;
use crate::state::AppState;
use crate::users::{self, Authenticated, Principal};
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// The authenticated caller of an API route.
pub struct Bearer(pub Principal);

async fn principal_of(parts: &Parts, state: &AppState) -> Result<Principal, ConsoleError> {
    if let Some(a) = parts.extensions.get::<Authenticated>() {
        return Ok(a.0.clone());
    }
    let token = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or(ConsoleError::Unauthorized)?;
    users::by_token(&state.pool, &state.schema, token)
        .await?
        .ok_or(ConsoleError::Unauthorized)
}

impl FromRequestParts<AppState> for Bearer {
    type Rejection = ConsoleError;
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        principal_of(parts, state).await.map(Bearer)
    }
}

/// Middleware of the action routes: the caller, before the idempotency layer needs its scope
/// (401 here, nothing reserved).
async fn authenticate(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    match principal_of(&parts, &state).await {
        Ok(p) => {
            parts.extensions.insert(Authenticated(p));
            next.run(Request::from_parts(parts, body)).await
        }
        Err(e) => e.into_response(),
    }
}

/// Middleware of the action routes: after an action (committed by then, also through the
/// idempotency layer), the pending-approvals gauge.
async fn settle(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    // Only an action that was done (or requested for approval) can change the count.
    if response.status().is_success() {
        crate::approvals::refresh_pending_gauge(&state).await;
    }
    response
}

/// Every route of the API.
pub fn router(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/api/outbox/dead", get(dead_rows))
        .route("/api/outbox/backlog", get(backlog))
        .route("/api/dead-letters", get(dead_letter_list))
        .route("/api/idempotency", post(idempotency))
        .route("/api/audit", get(audit_list))
        .route("/api/approvals", get(approval_list))
        .route("/api/processes", get(process_list))
        .route("/api/processes/{id}", get(process_get))
        .route("/api/consumers/{consumer}/ordered", get(ordered_view))
        .route("/api/whoami", get(whoami))
        .route("/api/openapi.json", get(crate::openapi::serve))
        .merge(actions(state))
        .layer(axum::middleware::from_fn(json_errors))
}

/// Every error the API answers has the one shape `{"error": "..."}`. The console's own errors
/// have it already; axum's rejections do not (a path id that is no UUID, a query that does not
/// parse: plain text; a method the route does not take: an empty 405). This gives them that shape,
/// with their text as the message (for a 5xx, only "internal server error"), keeping their status
/// and headers (`Allow`, `Retry-After`).
async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let error = if status.is_server_error() {
        "internal server error".to_string()
    } else if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("bad request")
            .to_lowercase()
    } else {
        text
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::json!({ "error": error }).to_string();
    Response::from_parts(parts, Body::from(body))
}

/// The action routes: authentication, then the Idempotency-Key ([`keys::optional`]), then the
/// handler.
pub fn actions(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/api/outbox/dead/actions/requeue", post(requeue_many))
        .route("/api/outbox/dead/{id}/actions/requeue", post(requeue_one))
        .route("/api/dead-letters/{consumer}/actions/replay", post(replay))
        .route("/api/audit/actions/purge", post(audit_purge))
        .route("/api/approvals/{id}/approve", post(approve))
        .route("/api/approvals/{id}/reject", post(reject))
        .route("/api/processes/{id}/actions/{action}", post(process_action))
        .route(
            "/api/consumers/{consumer}/ordered/actions/{action}",
            post(ordered_action),
        )
        .route_layer(from_fn_with_state(state.clone(), keys::optional))
        .route_layer(from_fn_with_state(state.clone(), authenticate))
        .route_layer(from_fn_with_state(state.clone(), settle))
}

/// Sends a web form's action, as `principal`, to the action route `path` with JSON `body` and the
/// form's Idempotency-Key: the same path an API client's request takes.
pub async fn forward(
    state: &AppState,
    principal: &Principal,
    path: &str,
    key: Option<&str>,
    body: &serde_json::Value,
) -> Response {
    let mut builder = axum::http::Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = key {
        builder = builder.header(idempotency::KEY_HEADER, k);
    }
    let mut request = match builder.body(Body::from(body.to_string())) {
        Ok(r) => r,
        Err(_) => {
            return ConsoleError::BadRequest("the form's idempotency key is malformed".into())
                .into_response();
        }
    };
    request
        .extensions_mut()
        .insert(Authenticated(principal.clone()));
    let mut router = actions(state).with_state(state.clone());
    match tower_service::Service::call(&mut router, request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// An action's answer (replays are answered by the idempotency layer, byte for byte).
pub fn outcome_response(o: Outcome) -> Response {
    let mut r = (o.status, o.body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The body of an action request as `T`. A body that is not one is a 400, but only for a caller
/// who may do `action` on `target`: anyone else gets (and the audit log records) the 403 first.
async fn parse_for<T: DeserializeOwned>(
    state: &AppState,
    p: &Principal,
    action: Action,
    target: &str,
    body: &Bytes,
) -> Result<T, ConsoleError> {
    match serde_json::from_slice(body) {
        Ok(t) => Ok(t),
        Err(e) => {
            actions::authorize(state, p, action, target, "").await?;
            Err(ConsoleError::BadRequest(format!("invalid JSON body: {e}")))
        }
    }
}

async fn read(state: &AppState, p: &Principal, what: &str) -> Result<(), ConsoleError> {
    actions::authorize(state, p, Action::Read, what, "").await
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct Limit {
    /// At most this many (default 100).
    pub limit: Option<i64>,
}

/// Dead outbox rows, oldest first.
#[utoipa::path(get, path = "/api/outbox/dead", tag = "outbox", params(Limit),
    responses((status = 200, body = [outbox_dead::DeadRow]), (status = 401, body = crate::error::ErrorBody)))]
pub async fn dead_rows(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(q): Query<Limit>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "outbox:dead").await?;
    Ok(Json(outbox_dead::list(&s.pool, &s.schema, q.limit.unwrap_or(100)).await?).into_response())
}

/// Pending backlog and dead count.
#[utoipa::path(get, path = "/api/outbox/backlog", tag = "outbox", responses((status = 200, body = outbox_dead::Backlog)))]
pub async fn backlog(
    State(s): State<AppState>,
    Bearer(p): Bearer,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "outbox:backlog").await?;
    Ok(Json(outbox_dead::backlog(&s.pool, &s.schema).await?).into_response())
}

/// Body of a single requeue.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RequeueOne {
    pub reason: String,
    /// The row version seen (`version` of the listing).
    pub version: i64,
}

/// Body of a bulk requeue.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RequeueMany {
    pub reason: String,
    pub items: Vec<outbox_dead::Item>,
    /// Only say what each would do.
    #[serde(default)]
    pub dry_run: bool,
}

/// Requeue one dead row (operator).
#[utoipa::path(post, path = "/api/outbox/dead/{id}/actions/requeue", tag = "outbox", request_body = RequeueOne,
    params(("id" = Uuid, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "requeued"), (status = 403, body = crate::error::ErrorBody),
               (status = 409, description = "stale version: nothing changed", body = crate::error::ErrorBody)))]
pub async fn requeue_one(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: RequeueOne = parse_for(
        &s,
        &p,
        Action::OutboxRequeue,
        &format!("outbox:{id}"),
        &body,
    )
    .await?;
    let items = vec![outbox_dead::Item {
        id,
        version: b.version,
    }];
    Ok(outcome_response(
        commands::requeue_outbox(&s, &p, items, &b.reason, false, keyed).await?,
    ))
}

/// Requeue several dead rows: an explicit list; more than one creates an approval request (202);
/// `dry_run` says what each would do.
#[utoipa::path(post, path = "/api/outbox/dead/actions/requeue", tag = "outbox", request_body = RequeueMany,
    responses((status = 200, description = "done or dry run"), (status = 202, description = "approval request created")))]
pub async fn requeue_many(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: RequeueMany = parse_for(&s, &p, Action::OutboxRequeue, "outbox:", &body).await?;
    Ok(outcome_response(
        commands::requeue_outbox(&s, &p, b.items, &b.reason, b.dry_run, keyed).await?,
    ))
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct ConsumerQuery {
    /// The consumer's name (its queue; dead letters are in `<name>.dlq`).
    pub consumer: String,
    pub limit: Option<usize>,
}

/// A consumer's dead letters with their reasons (left in place).
#[utoipa::path(get, path = "/api/dead-letters", tag = "dead-letters", params(ConsumerQuery),
    responses((status = 200, body = [dead_letters::Letter])))]
pub async fn dead_letter_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(q): Query<ConsumerQuery>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, &format!("dlq:{}", q.consumer)).await?;
    dead_letters::listed(&s.settings.consumers, &q.consumer)?;
    Ok(Json(
        dead_letters::list(
            &s.settings.amqp_url,
            &s.settings.amqp_tls,
            &q.consumer,
            q.limit.unwrap_or(100),
        )
        .await?,
    )
    .into_response())
}

/// Body of a replay.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Replay {
    pub reason: String,
    pub items: Vec<dead_letters::Item>,
    #[serde(default)]
    pub dry_run: bool,
}

/// Replay dead letters: one runs now, more than one needs approval. An ordered consumer's dead
/// letters are never replayed: 409, with what to do instead.
#[utoipa::path(post, path = "/api/dead-letters/{consumer}/actions/replay", tag = "dead-letters", request_body = Replay,
    params(("consumer" = String, Path)), responses((status = 200), (status = 202),
        (status = 409, description = "a version changed, or the consumer is ordered", body = crate::error::ErrorBody)))]
pub async fn replay(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(consumer): Path<String>,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: Replay = parse_for(&s, &p, Action::DlqReplay, &format!("dlq:{consumer}"), &body).await?;
    Ok(outcome_response(
        commands::replay_dead_letters(&s, &p, consumer, b.items, &b.reason, b.dry_run, keyed)
            .await?,
    ))
}

/// Body of an idempotency lookup: a POST, so the key never travels in a URL (logs, history).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct IdempotencyQuery {
    /// The key's scope (tenant, account).
    pub scope: String,
    /// The Idempotency-Key value (hashed before the lookup, never stored).
    pub key: String,
}

/// An idempotency record's status and times (never bodies).
#[derive(Debug, Serialize, ToSchema)]
pub struct IdempotencyRecord {
    pub operation: String,
    pub status: String,
    pub response_status: Option<i16>,
    pub resource_id: Option<Uuid>,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub updated_at: chrono::DateTime<chrono::Utc>,
    pub expires_at: chrono::DateTime<chrono::Utc>,
    pub lease_expires_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Look up idempotency records by scope and key (a read, sent as a POST: the key is in the body).
#[utoipa::path(post, path = "/api/idempotency", tag = "idempotency", request_body = IdempotencyQuery,
    responses((status = 200, body = [IdempotencyRecord])))]
pub async fn idempotency(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "idempotency").await?;
    let q: IdempotencyQuery = serde_json::from_slice(&body)
        .map_err(|e| ConsoleError::BadRequest(format!("invalid JSON body: {e}")))?;
    Ok(Json(lookup_idempotency(&s, &q.scope, &q.key).await?).into_response())
}

/// The records of `key` in `scope`, through the `idempotency` crate (which owns the table).
pub async fn lookup_idempotency(
    s: &AppState,
    scope: &str,
    key: &str,
) -> Result<Vec<IdempotencyRecord>, ConsoleError> {
    crate::text::check_all([("scope", Some(scope)), ("key", Some(key))])?;
    let rows = s.idempotency.lookup(scope, key).await?;
    Ok(rows
        .into_iter()
        .map(|r| IdempotencyRecord {
            operation: redact::text(&r.operation),
            status: r.status,
            response_status: r.response_status,
            resource_id: r.resource_id,
            created_at: r.created_at,
            updated_at: r.updated_at,
            expires_at: r.expires_at,
            lease_expires_at: r.lease_expires_at,
        })
        .collect())
}

/// The audit log, newest first, filtered; `format=jsonl` exports JSON lines, oldest first.
#[utoipa::path(get, path = "/api/audit", tag = "audit", params(audit::Filter), responses((status = 200, body = [audit::Entry])))]
pub async fn audit_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(f): Query<audit::Filter>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "audit").await?;
    f.check()?;
    if f.format.as_deref() == Some("jsonl") {
        let rows = audit::list(&s.pool, &s.schema, &f, true).await?;
        let mut out = String::new();
        for r in rows {
            out.push_str(
                &serde_json::to_string(&r).map_err(|e| ConsoleError::Internal(e.to_string()))?,
            );
            out.push('\n');
        }
        return Ok(([(header::CONTENT_TYPE, "application/jsonl")], out).into_response());
    }
    Ok(Json(audit::list(&s.pool, &s.schema, &f, false).await?).into_response())
}

/// Body of actions that only need a reason.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReasonOnly {
    pub reason: String,
}

/// Purge audit entries older than the retention (admin).
#[utoipa::path(post, path = "/api/audit/actions/purge", tag = "audit", request_body = ReasonOnly, responses((status = 200)))]
pub async fn audit_purge(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: ReasonOnly = parse_for(&s, &p, Action::AuditPurge, "audit", &body).await?;
    Ok(outcome_response(
        commands::purge_audit(&s, &p, &b.reason, keyed).await?,
    ))
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct StatusQuery {
    /// pending, approved, rejected.
    pub status: Option<String>,
}

/// Approval requests, newest first.
#[utoipa::path(get, path = "/api/approvals", tag = "approvals", params(StatusQuery), responses((status = 200, body = [approvals::Approval])))]
pub async fn approval_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(q): Query<StatusQuery>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "approvals").await?;
    crate::text::check("status", q.status.as_deref().unwrap_or(""))?;
    Ok(Json(approvals::list(&s.pool, &s, q.status.as_deref()).await?).into_response())
}

async fn decide(
    s: AppState,
    p: Principal,
    id: Uuid,
    keyed: Option<idempotency::Effect>,
    body: Bytes,
    approve: bool,
) -> Result<Response, ConsoleError> {
    let action = if approve {
        Action::ApprovalApprove
    } else {
        Action::ApprovalReject
    };
    let d: Decision = parse_for(&s, &p, action, &format!("approval:{id}"), &body).await?;
    Ok(outcome_response(
        commands::decide(&s, &p, id, d, approve, keyed).await?,
    ))
}

/// Approve a request of someone else (approver): the effect runs now, once.
#[utoipa::path(post, path = "/api/approvals/{id}/approve", tag = "approvals", request_body = Decision,
    params(("id" = Uuid, Path)), responses((status = 200), (status = 403), (status = 409)))]
pub async fn approve(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    decide(s, p, id, keyed, body, true).await
}

/// Reject a request of someone else (approver): nothing runs.
#[utoipa::path(post, path = "/api/approvals/{id}/reject", tag = "approvals", request_body = Decision,
    params(("id" = Uuid, Path)), responses((status = 200), (status = 403), (status = 409)))]
pub async fn reject(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    decide(s, p, id, keyed, body, false).await
}

/// Processes, manual_review first, then most recently changed.
#[utoipa::path(get, path = "/api/processes", tag = "processes", params(ProcessFilter), responses((status = 200)))]
pub async fn process_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(f): Query<ProcessFilter>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "processes").await?;
    f.check()?;
    let list = s.processes.list(&s.pool, &f).await?;
    Ok(Json(list.iter().map(redact::value).collect::<Vec<_>>()).into_response())
}

/// One process: its steps, last classified error, history, `version` and the actions allowed now.
#[utoipa::path(get, path = "/api/processes/{id}", tag = "processes", params(("id" = Uuid, Path)), responses((status = 200), (status = 404)))]
pub async fn process_get(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, &format!("process:{id}")).await?;
    let v = s
        .processes
        .get(&s.pool, id)
        .await?
        .ok_or_else(|| ConsoleError::NotFound(format!("process {id}")))?;
    Ok(Json(redact::value(&v)).into_response())
}

/// Perform an action on a process: one the process offers now (`allowed_actions`); the sensitive
/// ones (run_compensation, resolve_succeeded) create an approval request.
#[utoipa::path(post, path = "/api/processes/{id}/actions/{action}", tag = "processes", request_body = ProcessActionRequest,
    params(("id" = Uuid, Path), ("action" = String, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "done"), (status = 202, description = "approval request created"), (status = 403, body = crate::error::ErrorBody),
               (status = 409, description = "stale version or not allowed now: nothing changed", body = crate::error::ErrorBody),
               (status = 422, description = "Idempotency-Key used for another request", body = crate::error::ErrorBody)))]
pub async fn process_action(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path((id, action)): Path<(Uuid, String)>,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let action = crate::processes::parse_action(&action)
        .ok_or_else(|| ConsoleError::NotFound(format!("process action {action:?}")))?;
    let r: ProcessActionRequest = parse_for(
        &s,
        &p,
        Action::Process(action),
        &format!("process:{id}"),
        &body,
    )
    .await?;
    Ok(outcome_response(
        commands::process_action(&s, &p, id, action, r, keyed).await?,
    ))
}

/// An ordered consumer: its partitions (owner, epoch, lease) and its stuck aggregates (parked
/// heads; gaps waited on longer than `CONSOLE_ORDERED_GAP_SECONDS`) with their first held
/// messages.
#[utoipa::path(get, path = "/api/consumers/{consumer}/ordered", tag = "ordered-consumers",
    params(("consumer" = String, Path)),
    responses((status = 200, body = ordered::ConsumerView), (status = 404, body = crate::error::ErrorBody)))]
pub async fn ordered_view(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(consumer): Path<String>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, &format!("ordered:{consumer}")).await?;
    dead_letters::listed(&s.settings.consumers, &consumer)?;
    Ok(
        Json(ordered::view(&s.pool, &s.schema, &consumer, s.settings.ordered_gap_after).await?)
            .into_response(),
    )
}

/// An action on a stuck aggregate of an ordered consumer: `retry` runs now; `skip` and
/// `dead_letter_run` discard messages, so they create an approval request (a dry run says what
/// they would dead-letter).
#[utoipa::path(post, path = "/api/consumers/{consumer}/ordered/actions/{action}", tag = "ordered-consumers",
    request_body = ordered::AggregateAction,
    params(("consumer" = String, Path), ("action" = String, Path), ("Idempotency-Key" = Option<String>, Header)),
    responses((status = 200, description = "done"), (status = 202, description = "approval request created"), (status = 403, body = crate::error::ErrorBody),
               (status = 404, description = "no such consumer, action or aggregate", body = crate::error::ErrorBody),
               (status = 409, description = "the aggregate moved on since the version seen, or nothing to do: nothing changed", body = crate::error::ErrorBody)))]
pub async fn ordered_action(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path((consumer, action)): Path<(String, String)>,
    Keyed(keyed): Keyed,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let action: OrderedAction = action.parse()?;
    let b: ordered::AggregateAction = parse_for(
        &s,
        &p,
        Action::Ordered(action),
        &format!("ordered:{consumer}"),
        &body,
    )
    .await?;
    Ok(outcome_response(
        commands::ordered_action(&s, &p, consumer, action, b, keyed).await?,
    ))
}

/// Who the token belongs to.
#[utoipa::path(get, path = "/api/whoami", tag = "users", responses((status = 200, body = Principal)))]
pub async fn whoami(Bearer(p): Bearer) -> Json<Principal> {
    Json(p)
}

/// 404 for unknown API paths, as JSON.
pub async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(crate::error::ErrorBody {
            error: "no such route".into(),
        }),
    )
        .into_response()
}
