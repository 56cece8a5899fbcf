//! The operator's side of the simulator: `GET /admin/charges` (every charge, for verification)
//! and `GET`/`POST /admin/faults` (the fault set, changed at run time).

use crate::api::{Charge, FaultsBody};
use crate::charges::ChargeRow;
use crate::error::{ApiError, Body};
use crate::faults::FaultSet;
use crate::internal_events;
use crate::state::AppState;
use axum::Json;
use axum::extract::State;

/// `GET /admin/charges`: every charge, oldest first.
pub async fn charges(State(state): State<AppState>) -> Result<Json<Vec<Charge>>, ApiError> {
    let rows: Vec<ChargeRow> = sqlx::query_as(
        "SELECT id, reference, amount, currency, status, idempotency_key, created_at, refunded_at
           FROM provider.charges ORDER BY created_at, id",
    )
    .fetch_all(&state.pool)
    .await?;
    rows.into_iter()
        .map(ChargeRow::into_charge)
        .collect::<Result<_, _>>()
        .map(Json)
}

/// `GET /admin/faults`: the faults in force, normalised.
pub async fn faults(State(state): State<AppState>) -> Json<FaultsBody> {
    Json(FaultsBody {
        faults: state.faults.current().to_string(),
    })
}

/// `POST /admin/faults` with `{"faults": "mode:percent,..."}`: replaces the fault set (an empty
/// string clears it) and answers the new set, normalised.
pub async fn set_faults(
    State(state): State<AppState>,
    Body(body): Body<FaultsBody>,
) -> Result<Json<FaultsBody>, ApiError> {
    let set: FaultSet = body
        .faults
        .parse()
        .map_err(|e: crate::faults::FaultSyntaxError| ApiError::BadRequest(e.to_string()))?;
    state.faults.set(set);
    internal_events::faults_changed(&set);
    Ok(Json(FaultsBody {
        faults: set.to_string(),
    }))
}
