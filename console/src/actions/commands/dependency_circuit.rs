//! An operator's hand on a dependency's circuit: hold it open (a remote known to be broken, a
//! maintenance it announced) or close it again. Reversible and moving no money, so one operator
//! may do it; reasoned and audited with the circuit before and after, and recorded in the
//! dependency's own history too.

use crate::actions::Action;
use crate::actions::{self, Caller, Effect, Outcome};
use crate::error::ConsoleError;
use crate::targets::dependencies;

/// Opens (`open`) or closes the circuit of dependency `name`.
pub async fn dependency_circuit(
    call: &Caller,
    name: &str,
    open: bool,
    reason: &str,
) -> Result<Outcome, ConsoleError> {
    let action = Action::DependencyCircuit(open);
    let target = format!("dependency:{name}");
    let reason = match actions::require_reason(reason) {
        Ok(r) => r,
        Err(e) => {
            call.authorize(action, &target, reason).await?;
            return Err(e);
        }
    };
    let name = name.to_string();
    actions::perform(call, action, target, reason, move |on| {
        Box::pin(async move {
            let (changes, body) = dependencies::set(
                on.conn,
                &on.state.schema,
                &name,
                open,
                &on.principal.name,
                on.reason,
            )
            .await?;
            Ok(Effect::ok(changes, body))
        })
    })
    .await
}
