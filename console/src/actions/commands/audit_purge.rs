//! Purging audit entries past the retention.

use crate::actions::Action;
use crate::actions::audit;
use crate::actions::{self, Caller, Effect, Outcome};
use crate::error::ConsoleError;
use serde_json::json;

/// Purge audit entries older than the configured retention (admin).
pub async fn purge_audit(call: &Caller, reason: &str) -> Result<Outcome, ConsoleError> {
    let target = "audit".to_string();
    call.authorize(Action::AuditPurge, &target, reason).await?;
    let reason = actions::require_reason(reason)?;
    actions::perform(call, Action::AuditPurge, target, reason, move |on| {
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
