//! A process as the console shows it (JSON): the processes crate's view with the row version,
//! the last classified error, the unknown outcomes and the actions offered now.

use super::words::of_admin;
use crate::error::ConsoleError;
use chrono::{DateTime, Utc};
use processes::admin::{self, Action as AdminAction};
use serde::Serialize;
use serde_json::{Value, json};

/// `v` as JSON; a value that will not serialize is the console's internal error.
pub(super) fn to_value<T: Serialize>(v: &T) -> Result<Value, ConsoleError> {
    serde_json::to_value(v).map_err(|e| ConsoleError::Internal(e.to_string()))
}

/// A summary as the console shows it: the processes crate's fields, `row_version` as `version`.
pub(super) fn summary(p: &admin::ProcessSummary) -> Result<Value, ConsoleError> {
    let mut v = to_value(p)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("version".into(), json!(p.row_version));
    }
    Ok(v)
}

/// The last classified error of any step: the most recently attempted step that has one.
pub(super) fn last_error(steps: &[admin::StepView]) -> Value {
    steps
        .iter()
        .filter(|s| s.error_class.is_some())
        .max_by_key(|s| (s.last_attempt_at.unwrap_or(DateTime::<Utc>::MIN_UTC), s.seq))
        .map(|s| {
            json!({
                "step": s.seq,
                "name": s.name,
                "role": s.role,
                "class": s.error_class,
                "message": s.error_message,
                "at": s.last_attempt_at,
            })
        })
        .unwrap_or(Value::Null)
}

/// The actions allowed now, as the console offers them (safe ones first, as the processes crate
/// orders them), with what each needs: a second approver, evidence, a remote check.
pub(super) fn offered(v: &admin::ProcessView) -> Value {
    let safe: Vec<&AdminAction> = v
        .doubts
        .iter()
        .filter_map(|d| d.safe_action.as_ref())
        .collect();
    Value::Array(
        v.allowed
            .iter()
            .filter_map(|a| of_admin(a).map(|o| (a, o)))
            .map(|(a, (action, step))| {
                let needs = admin::requirements(a, &v.steps);
                json!({
                    "action": action.name(),
                    "step": step,
                    "min_role": crate::auth::roles::process_min_role(action),
                    "needs_approval": needs.second_person,
                    "needs_evidence": needs.evidence,
                    "needs_remote_check": needs.remote_check,
                    "safe_for_unknown_outcome": safe.contains(&a),
                })
            })
            .collect(),
    )
}

/// The steps whose outcome is unknown: the remote may have acted; the safe action first.
pub(super) fn unknown_outcomes(v: &admin::ProcessView) -> Value {
    Value::Array(
        v.doubts
            .iter()
            .map(|d| {
                json!({
                    "step": d.seq,
                    "name": d.name,
                    "remote": d.remote,
                    "remote_may_have_acted": true,
                    "warning": d.warning,
                    "safe_action": d.safe_action.as_ref()
                        .and_then(of_admin)
                        .map(|(a, _)| a.name()),
                })
            })
            .collect(),
    )
}

/// The steps as the processes crate shows them, each with `parked`: the process is parked on it
/// (a wait or a timer), by the processes crate's rule ([`admin::StepView::is_parked`]).
fn steps_json(steps: &[admin::StepView]) -> Result<Value, ConsoleError> {
    let mut out = Vec::with_capacity(steps.len());
    for s in steps {
        let mut v = to_value(s)?;
        if let Some(o) = v.as_object_mut() {
            o.insert("parked".into(), Value::Bool(s.is_parked()));
        }
        out.push(v);
    }
    Ok(Value::Array(out))
}

/// The whole process as `GET /api/processes/{id}` answers it (before redaction).
pub(super) fn view_json(v: &admin::ProcessView) -> Result<Value, ConsoleError> {
    let mut out = summary(&v.process)?;
    if let Some(o) = out.as_object_mut() {
        o.insert("input".into(), v.input.clone());
        o.insert("money".into(), to_value(&v.money)?);
        o.insert("last_error".into(), last_error(&v.steps));
        o.insert("unknown_outcomes".into(), unknown_outcomes(v));
        o.insert("steps".into(), steps_json(&v.steps)?);
        o.insert("history".into(), to_value(&v.history)?);
        o.insert("allowed_actions".into(), offered(v));
    }
    Ok(out)
}
