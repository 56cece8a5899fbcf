//! The JSON API under `/api`, for bearer tokens (`Authorization: Bearer ct_...`). Every response
//! is redacted; every error is `{"error": "..."}`.

use crate::action_keys::{self, Key};
use crate::actions::{self, Outcome};
use crate::approvals::{self, Decision};
use crate::audit;
use crate::commands;
use crate::dead_letters;
use crate::error::ConsoleError;
use crate::outbox_dead;
use crate::processes::{self, ProcessAction, ProcessActionRequest, ProcessFilter};
use crate::redact;
use crate::roles::Action;
use crate::state::AppState;
use crate::users::{self, Principal};
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// The authenticated caller of an API route.
pub struct Bearer(pub Principal);

impl FromRequestParts<AppState> for Bearer {
    type Rejection = ConsoleError;
    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(ConsoleError::Unauthorized)?;
        users::by_token(&state.pool, &state.schema, token)
            .await?
            .map(Bearer)
            .ok_or(ConsoleError::Unauthorized)
    }
}

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/api/outbox/dead", get(dead_rows))
        .route("/api/outbox/dead/actions/requeue", post(requeue_many))
        .route("/api/outbox/dead/{id}/actions/requeue", post(requeue_one))
        .route("/api/outbox/backlog", get(backlog))
        .route("/api/dead-letters", get(dead_letter_list))
        .route("/api/dead-letters/{consumer}/actions/replay", post(replay))
        .route("/api/idempotency", get(idempotency))
        .route("/api/audit", get(audit_list))
        .route("/api/audit/actions/purge", post(audit_purge))
        .route("/api/approvals", get(approval_list))
        .route("/api/approvals/{id}/approve", post(approve))
        .route("/api/approvals/{id}/reject", post(reject))
        .route("/api/processes", get(process_list))
        .route("/api/processes/{id}", get(process_get))
        .route("/api/processes/{id}/actions/{action}", post(process_action))
        .route("/api/whoami", get(whoami))
        .route("/api/openapi.json", get(crate::openapi::serve))
}

/// An action's answer, with `Idempotent-Replayed: true` on replays.
pub fn outcome_response(o: Outcome) -> Response {
    let mut r = (o.status, o.body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if o.replayed {
        r.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    r
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ConsoleError> {
    serde_json::from_slice(body)
        .map_err(|e| ConsoleError::BadRequest(format!("invalid JSON body: {e}")))
}

fn key(headers: &HeaderMap, path: &str, body: &[u8]) -> Result<Option<Key>, ConsoleError> {
    match headers.get(action_keys::HEADER) {
        None => Ok(None),
        Some(v) => {
            let k = v
                .to_str()
                .map_err(|_| ConsoleError::BadRequest("Idempotency-Key must be ASCII".into()))?;
            Key::new(k, "POST", path, body).map(Some)
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
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let path = format!("/api/outbox/dead/{id}/actions/requeue");
    let b: RequeueOne = match parse(&body) {
        Ok(b) => b,
        Err(e) => {
            actions::authorize(&s, &p, Action::OutboxRequeue, &format!("outbox:{id}"), "").await?;
            return Err(e);
        }
    };
    let k = key(&headers, &path, &body)?;
    let items = vec![outbox_dead::Item {
        id,
        version: b.version,
    }];
    Ok(outcome_response(
        commands::requeue_outbox(&s, &p, items, &b.reason, false, k).await?,
    ))
}

/// Requeue several dead rows: an explicit list; more than one creates an approval request (202);
/// `dry_run` says what each would do.
#[utoipa::path(post, path = "/api/outbox/dead/actions/requeue", tag = "outbox", request_body = RequeueMany,
    responses((status = 200, description = "done or dry run"), (status = 202, description = "approval request created")))]
pub async fn requeue_many(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: RequeueMany = match parse(&body) {
        Ok(b) => b,
        Err(e) => {
            actions::authorize(&s, &p, Action::OutboxRequeue, "outbox:", "").await?;
            return Err(e);
        }
    };
    let k = key(&headers, "/api/outbox/dead/actions/requeue", &body)?;
    Ok(outcome_response(
        commands::requeue_outbox(&s, &p, b.items, &b.reason, b.dry_run, k).await?,
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

/// Replay dead letters: one runs now, more than one needs approval.
#[utoipa::path(post, path = "/api/dead-letters/{consumer}/actions/replay", tag = "dead-letters", request_body = Replay,
    params(("consumer" = String, Path)), responses((status = 200), (status = 202)))]
pub async fn replay(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(consumer): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: Replay = match parse(&body) {
        Ok(b) => b,
        Err(e) => {
            actions::authorize(&s, &p, Action::DlqReplay, &format!("dlq:{consumer}"), "").await?;
            return Err(e);
        }
    };
    let k = key(
        &headers,
        &format!("/api/dead-letters/{consumer}/actions/replay"),
        &body,
    )?;
    Ok(outcome_response(
        commands::replay_dead_letters(&s, &p, consumer, b.items, &b.reason, b.dry_run, k).await?,
    ))
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct IdempotencyQuery {
    /// The key's scope (tenant, account).
    pub scope: String,
    /// The Idempotency-Key value (hashed before the lookup, never stored).
    pub key: String,
}

/// An idempotency record's status and times (never bodies).
#[derive(Debug, Serialize, ToSchema, sqlx::FromRow)]
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

/// Look up idempotency records by scope and key.
#[utoipa::path(get, path = "/api/idempotency", tag = "idempotency", params(IdempotencyQuery),
    responses((status = 200, body = [IdempotencyRecord])))]
pub async fn idempotency(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(q): Query<IdempotencyQuery>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "idempotency").await?;
    Ok(Json(lookup_idempotency(&s, &q.scope, &q.key).await?).into_response())
}

pub async fn lookup_idempotency(
    s: &AppState,
    scope: &str,
    key: &str,
) -> Result<Vec<IdempotencyRecord>, ConsoleError> {
    use sha2::Digest;
    let mut rows = sqlx::query_as::<_, IdempotencyRecord>(s.schema.sql(
        "SELECT operation, status, response_status, resource_id, created_at, updated_at, expires_at, lease_expires_at \
         FROM {{schema}}.idempotency_keys WHERE scope = $1 AND key_hash = $2 ORDER BY created_at",
    ))
    .bind(scope)
    .bind(sha2::Sha256::digest(key.as_bytes()).to_vec())
    .fetch_all(&s.pool)
    .await?;
    for r in &mut rows {
        r.operation = redact::text(&r.operation);
    }
    Ok(rows)
}

/// The audit log, newest first, filtered; `format=jsonl` exports JSON lines, oldest first.
#[utoipa::path(get, path = "/api/audit", tag = "audit", params(audit::Filter), responses((status = 200, body = [audit::Entry])))]
pub async fn audit_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(f): Query<audit::Filter>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "audit").await?;
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
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let b: ReasonOnly = match parse(&body) {
        Ok(b) => b,
        Err(e) => {
            actions::authorize(&s, &p, Action::AuditPurge, "audit", "").await?;
            return Err(e);
        }
    };
    let k = key(&headers, "/api/audit/actions/purge", &body)?;
    Ok(outcome_response(
        commands::purge_audit(&s, &p, &b.reason, k).await?,
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
    Ok(Json(approvals::list(&s.pool, &s, q.status.as_deref()).await?).into_response())
}

async fn decide(
    s: AppState,
    p: Principal,
    id: Uuid,
    headers: HeaderMap,
    body: Bytes,
    approve: bool,
) -> Result<Response, ConsoleError> {
    let action = if approve {
        Action::ApprovalApprove
    } else {
        Action::ApprovalReject
    };
    let d: Decision = match parse(&body) {
        Ok(d) => d,
        Err(e) => {
            actions::authorize(&s, &p, action, &format!("approval:{id}"), "").await?;
            return Err(e);
        }
    };
    let verb = if approve { "approve" } else { "reject" };
    let k = key(&headers, &format!("/api/approvals/{id}/{verb}"), &body)?;
    Ok(outcome_response(
        commands::decide(&s, &p, id, d, approve, k).await?,
    ))
}

/// Approve a request of someone else (approver): the effect runs now, once.
#[utoipa::path(post, path = "/api/approvals/{id}/approve", tag = "approvals", request_body = Decision,
    params(("id" = Uuid, Path)), responses((status = 200), (status = 403), (status = 409)))]
pub async fn approve(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    decide(s, p, id, headers, body, true).await
}

/// Reject a request of someone else (approver): nothing runs.
#[utoipa::path(post, path = "/api/approvals/{id}/reject", tag = "approvals", request_body = Decision,
    params(("id" = Uuid, Path)), responses((status = 200), (status = 403), (status = 409)))]
pub async fn reject(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    decide(s, p, id, headers, body, false).await
}

/// Processes, manual_review first (501 until the processes crate is plugged in).
#[utoipa::path(get, path = "/api/processes", tag = "processes", params(ProcessFilter), responses((status = 200), (status = 501)))]
pub async fn process_list(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Query(f): Query<ProcessFilter>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, "processes").await?;
    let backend = s.processes.clone().ok_or_else(processes::unavailable)?;
    let list = backend.list(&s.pool, &f).await?;
    Ok(Json(list.iter().map(redact::value).collect::<Vec<_>>()).into_response())
}

/// One process with the actions allowed now.
#[utoipa::path(get, path = "/api/processes/{id}", tag = "processes", params(("id" = Uuid, Path)), responses((status = 200), (status = 404), (status = 501)))]
pub async fn process_get(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path(id): Path<Uuid>,
) -> Result<Response, ConsoleError> {
    read(&s, &p, &format!("process:{id}")).await?;
    let backend = s.processes.clone().ok_or_else(processes::unavailable)?;
    let v = backend
        .get(&s.pool, id)
        .await?
        .ok_or_else(|| ConsoleError::NotFound(format!("process {id}")))?;
    Ok(Json(redact::value(&v)).into_response())
}

/// Perform an action on a process (the sensitive ones create an approval request).
#[utoipa::path(post, path = "/api/processes/{id}/actions/{action}", tag = "processes", request_body = ProcessActionRequest,
    params(("id" = Uuid, Path), ("action" = String, Path)), responses((status = 200), (status = 202), (status = 403), (status = 409), (status = 501)))]
pub async fn process_action(
    State(s): State<AppState>,
    Bearer(p): Bearer,
    Path((id, action)): Path<(Uuid, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let action = ProcessAction::parse(&action)
        .ok_or_else(|| ConsoleError::NotFound(format!("process action {action:?}")))?;
    let r: ProcessActionRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => {
            actions::authorize(
                &s,
                &p,
                Action::Process(action),
                &format!("process:{id}"),
                "",
            )
            .await?;
            return Err(e);
        }
    };
    let k = key(
        &headers,
        &format!("/api/processes/{id}/actions/{}", action.name()),
        &body,
    )?;
    Ok(outcome_response(
        commands::process_action(&s, &p, id, action, r, k).await?,
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
