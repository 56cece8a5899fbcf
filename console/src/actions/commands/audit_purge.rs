//! Purging audit entries past the retention.

use crate::actions::Action;
use crate::actions::audit;
use crate::actions::{self, Effect, Outcome, Request};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;
use axum::http::StatusCode;
use serde_json::json;

/// Purge audit entries older than the configured retention (admin).
pub async fn purge_audit(
    state: &AppState,
    principal: &Principal,
    reason: &str,
    keyed: Option<idempotency::Effect>,
) -> Result<Outcome, ConsoleError> {
    let target = "audit".to_string();
    actions::authorize(state, principal, Action::AuditPurge, &target, reason).await?;
    let reason = actions::require_reason(reason)?;
    let (schema, days) = (state.schema.clone(), state.settings.audit_retention_days);
    let req = Request {
        principal,
        action: Action::AuditPurge,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |conn| {
        Box::pin(async move {
            let removed = audit::purge(conn, &schema, days).await?;
            Ok(Effect {
                status: StatusCode::OK,
                body: json!({"removed": removed, "retention_days": days}),
                changes: vec![crate::targets::Change {
                    target: "audit".into(),
                    after: Some(json!({"removed": removed, "retention_days": days})),
                    ..Default::default()
                }],
            })
        })
    })
    .await
}
