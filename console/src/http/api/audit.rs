//! `/api/audit...`: the audit log (JSON or JSON lines) and its purge.

use super::{Bearer, outcome_response, parse_for, read};
use crate::actions::audit;
use crate::actions::{Action, Caller, commands};
use crate::error::ConsoleError;
use crate::http::dto::ReasonOnly;
use crate::state::AppState;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The audit log, newest first, filtered, a keyset page at a time: `{items, total, next}` (`next`
/// is the `after` of the next page, null on the last); `format=jsonl` exports every matching
/// entry as JSON lines, oldest first.
#[utoipa::path(get, path = "/api/audit", tag = "audit", params(audit::Filter),
    responses((status = 200, description = "{items: [Entry], total, next}"),
               (status = 400, description = "a filter or cursor that is none", body = crate::error::ErrorBody)))]
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
    Ok(Json(crate::actions::audit_page::page(&s.pool, &s.schema, &f).await?).into_response())
}

/// Purge audit entries older than the retention (admin).
#[utoipa::path(post, path = "/api/audit/actions/purge", tag = "audit", request_body = ReasonOnly, responses((status = 200)))]
pub async fn audit_purge(call: Caller, body: Bytes) -> Result<Response, ConsoleError> {
    let b: ReasonOnly = parse_for(&call, Action::AuditPurge, "audit", &body).await?;
    Ok(outcome_response(
        commands::purge_audit(&call, &b.reason).await?,
    ))
}
