//! Dependencies (the `breaker` crate's `dependencies`): each remote's shared circuit, with the
//! processes waiting for it (`processes::look`), and an operator's hand on the circuit (hold it
//! open, close it), each audited with its state before and after.

use super::Change;
use crate::error::ConsoleError;
use breaker::admin::{self, DependencyView};
use processes::look::{self, DependencyWaiters};
use serde::Serialize;
use serde_json::{Value, json};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};

/// A dependency as the console shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Dependency {
    /// The circuit (`breaker::admin::DependencyView`).
    #[schema(value_type = Object)]
    pub circuit: DependencyView,
    /// Processes waiting for it, by kind.
    #[schema(value_type = Vec<Object>)]
    pub waiting: Vec<DependencyWaiters>,
}

impl Dependency {
    /// Not letting calls through (open, half open, or held open by an operator).
    pub fn is_down(&self) -> bool {
        self.circuit.forced_open || self.circuit.state != breaker::CircuitState::Closed
    }

    /// Processes waiting for it, all kinds.
    pub fn waiting_total(&self) -> i64 {
        self.waiting.iter().map(|w| w.count).sum()
    }
}

/// Every dependency with its waiting processes, the ones down first.
pub async fn list(pool: &PgPool, schema: &Schema) -> Result<Vec<Dependency>, ConsoleError> {
    let circuits = admin::list(pool, schema).await?;
    let waiting = look::waiting_for_dependencies(pool, schema).await?;
    Ok(circuits
        .into_iter()
        .map(|circuit| Dependency {
            waiting: waiting
                .iter()
                .filter(|w| w.dependency == circuit.name)
                .cloned()
                .collect(),
            circuit,
        })
        .collect())
}

fn snapshot(v: &DependencyView) -> Value {
    json!({
        "state": v.state,
        "forced_open": v.forced_open,
        "down_since": v.down_since,
        "version": v.version,
    })
}

/// Holds `name`'s circuit open (`open`) or closes it, in the action's transaction: the audit
/// entry has the circuit before and after.
pub async fn set(
    conn: &mut PgConnection,
    schema: &Schema,
    name: &str,
    open: bool,
    actor: &str,
    reason: &str,
) -> Result<(Vec<Change>, Value), ConsoleError> {
    let before = admin::get(conn, schema, name).await.map_err(admin_error)?;
    let after = if open {
        admin::force_open(conn, schema, name, actor, reason).await
    } else {
        admin::close(conn, schema, name, actor, reason).await
    }
    .map_err(admin_error)?;
    let change = Change {
        target: format!("dependency:{name}"),
        before: Some(snapshot(&before)),
        after: Some(snapshot(&after)),
        ..Default::default()
    };
    let body = serde_json::to_value(&after).unwrap_or(Value::Null);
    Ok((vec![change], body))
}

fn admin_error(e: breaker::AdminError) -> ConsoleError {
    match e {
        breaker::AdminError::NotFound(n) => {
            ConsoleError::NotFound(format!("no dependency named {n:?}"))
        }
        breaker::AdminError::Invalid(m) => ConsoleError::BadRequest(m),
        breaker::AdminError::Database(e) => e.into(),
    }
}
