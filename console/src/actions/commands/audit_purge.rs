//! Purging audit entries past the retention.

use crate::actions::Action;
use crate::actions::audit;
use crate::actions::{self, Effect, Outcome, Request};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;
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
    let req = Request {
        principal,
        action: Action::AuditPurge,
        target,
        reason,
        keyed,
    };
    actions::perform(state, req, move |on| {
        Box::pin(async move {
            let days = on.state.settings.audit_retention_days;
            let removed = audit::purge(on.conn, &on.state.schema, days).await?;
            let body = json!({"removed": removed, "retention_days": days});
            let changes = vec![crate::targets::Change {
                target: "audit".into(),
                after: Some(body.clone()),
                ..Default::default()
            }];
            Ok(Effect::ok(changes, body))
        })
    })
    .await
}
