//! Who asks for an action: the caller of an action route, as every command takes it.

use crate::actions::{Action, run};
use crate::auth::users::Principal;
use crate::error::ConsoleError;
use crate::state::AppState;

/// The caller of an action: the shared state, the authenticated principal, and the idempotency
/// layer's effect when the request carried an Idempotency-Key (its transaction is the one the
/// action writes into).
pub struct Caller {
    pub state: AppState,
    pub principal: Principal,
    pub keyed: Option<idempotency::Effect>,
}

impl Caller {
    /// Checks the role matrix for this caller ([`run::authorize`]): a refusal is audited, 403.
    pub async fn authorize(
        &self,
        action: Action,
        target: &str,
        reason: &str,
    ) -> Result<(), ConsoleError> {
        run::authorize(&self.state, &self.principal, action, target, reason).await
    }
}
