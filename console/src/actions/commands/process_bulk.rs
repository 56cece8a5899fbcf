//! A process action by filter: a dry run lists what the filter selects now; a request freezes
//! the selected (id, version) pairs in one approval request (four eyes, however few), whose
//! approval acts on exactly them (see [`crate::targets::processes::BULK_OFFERED`]).

use super::read;
use crate::actions::Action;
use crate::actions::approvals::{self, Pending};
use crate::actions::{self, Caller, Outcome};
use crate::error::ConsoleError;
use crate::targets::processes::{BulkPending, BulkRequest, Frozen, bulk_query};
use processes::admin::ActionKind;
use serde_json::{Value, json};

/// `action` on every process `request.filter` selects (see the module documentation). The role
/// check comes first, so a refused caller is audited whatever the filter says; a filter that is
/// none is a 400 after it.
pub async fn process_bulk(
    call: &Caller,
    action: ActionKind,
    request: BulkRequest,
) -> Result<Outcome, ConsoleError> {
    let target = format!(
        "processes?{}",
        request.filter.describe(request.step.as_deref())
    );
    let act = Action::Process(action);
    call.authorize(act, &target, &request.reason).await?;
    let query = bulk_query(action, &request)?;
    let state = &call.state;
    let plan = state
        .processes
        .plan_bulk(&state.pool, &query, action)
        .await?;
    let items: Vec<Frozen> = plan
        .iter()
        .filter(|p| p["allowed"] == json!(true))
        .filter_map(|p| {
            Some(Frozen {
                id: p["id"].as_str()?.parse().ok()?,
                version: p["version"].as_i64()?,
            })
        })
        .collect();
    if request.dry_run {
        return Ok(read(json!({
            "dry_run": true,
            "action": action.name(),
            "step": query.step,
            "matching": plan.len(),
            "selected": items.len(),
            "items": plan,
        })));
    }
    let reason = actions::require_reason(&request.reason)?;
    if items.is_empty() {
        return Err(ConsoleError::BadRequest(format!(
            "no process the filter selects allows {} now ({} match)",
            action.name(),
            plan.len()
        )));
    }
    let pending = Pending::ProcessBulk(BulkPending {
        action,
        step: query.step.clone(),
        filter: request.filter.clone(),
        items: items.clone(),
    });
    actions::perform(call, act, target, reason, move |mut on| {
        Box::pin(async move {
            let mut effect = approvals::create(&mut on, &pending).await?.effect();
            if let Value::Object(o) = &mut effect.body {
                o.insert("items".into(), json!(items));
                o.insert("selected".into(), json!(items.len()));
            }
            Ok(effect)
        })
    })
    .await
}
