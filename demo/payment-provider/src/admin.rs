//! The operator's side of the simulator: `GET /admin/charges` (every charge, for verification),
//! `GET`/`POST /admin/faults` (the fault set, changed at run time), `GET`/`POST /admin/mode`
//! (sync or async confirmation), `GET /admin/events` (the webhook events and their delivery), and
//! for reconciliation drills `POST /admin/charges` (record a charge as given) and
//! `POST /admin/charges/{id}` (overwrite its amount, currency or status).

use crate::api::{
    Charge, DeliveryStatus, EventRecord, EventType, FaultsBody, ModeBody, OutageBody,
};
use crate::charges::ChargeRow;
use crate::error::{ApiError, Body};
use crate::faults::FaultSet;
use crate::internal_events;
use crate::state::AppState;
use axum::Json;
use axum::extract::{Query, State};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

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

/// `GET /admin/outage`: the outage switch (`off`, or `503:<Retry-After>` / `429:<Retry-After>`).
pub async fn outage(State(state): State<AppState>) -> Json<OutageBody> {
    Json(OutageBody {
        outage: state.outage.get().to_string(),
    })
}

/// `POST /admin/outage` with `{"outage": "503:1" | "429:5" | "off"}`: every API call is answered
/// so from now on (nothing done), until switched back.
pub async fn set_outage(
    State(state): State<AppState>,
    Body(body): Body<OutageBody>,
) -> Result<Json<OutageBody>, ApiError> {
    let setting: crate::outage::OutageSetting = body
        .outage
        .parse()
        .map_err(|e: crate::outage::OutageSyntaxError| ApiError::BadRequest(e.to_string()))?;
    state.outage.set(setting);
    internal_events::outage_changed(setting);
    Ok(Json(OutageBody {
        outage: setting.to_string(),
    }))
}

/// `GET /admin/mode`: the confirmation mode in force.
pub async fn mode(State(state): State<AppState>) -> Json<ModeBody> {
    Json(ModeBody {
        mode: state.mode.get(),
    })
}

/// `POST /admin/mode` with `{"mode": "sync" | "async"}`: charges made from now on are confirmed
/// that way (charges already pending are still decided and reported).
pub async fn set_mode(State(state): State<AppState>, Body(body): Body<ModeBody>) -> Json<ModeBody> {
    state.mode.set(body.mode);
    internal_events::mode_changed(body.mode);
    Json(body)
}

#[derive(Debug, sqlx::FromRow)]
struct EventRow {
    id: String,
    charge_id: Uuid,
    #[sqlx(rename = "type")]
    kind: String,
    body: String,
    faults: Vec<String>,
    status: String,
    held: bool,
    attempts: i32,
    sends: i32,
    next_attempt_at: Option<DateTime<Utc>>,
    last_response: Option<String>,
    created_at: DateTime<Utc>,
    delivered_at: Option<DateTime<Utc>>,
}

impl EventRow {
    fn into_record(self) -> Result<EventRecord, ApiError> {
        let corrupt = |what: &str| ApiError::Corrupt(format!("event {} has {what}", self.id));
        let kind = EventType::parse(&self.kind).ok_or_else(|| corrupt("an unknown type"))?;
        let status =
            DeliveryStatus::parse(&self.status).ok_or_else(|| corrupt("an unknown status"))?;
        let body =
            serde_json::from_str(&self.body).map_err(|_| corrupt("a body that is no JSON"))?;
        Ok(EventRecord {
            id: self.id,
            charge_id: self.charge_id,
            kind,
            faults: self.faults,
            status,
            held: self.held,
            attempts: self.attempts,
            sends: self.sends,
            next_attempt_at: self.next_attempt_at,
            last_response: self.last_response,
            created_at: self.created_at,
            delivered_at: self.delivered_at,
            body,
        })
    }
}

#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    charge_id: Option<Uuid>,
}

/// `GET /admin/events[?charge_id=]`: every webhook event (of one charge), oldest first, with its
/// faults and where its delivery stands.
pub async fn events(
    State(state): State<AppState>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<EventRecord>>, ApiError> {
    let Query(q) = query?;
    let rows: Vec<EventRow> = sqlx::query_as(
        "SELECT id, charge_id, type, body, faults, status, held, attempts, sends, next_attempt_at,
                last_response, created_at, delivered_at
           FROM provider.events
          WHERE $1::uuid IS NULL OR charge_id = $1
          ORDER BY created_at, id",
    )
    .bind(q.charge_id)
    .fetch_all(&state.pool)
    .await?;
    rows.into_iter()
        .map(EventRow::into_record)
        .collect::<Result<_, _>>()
        .map(Json)
}

/// The body of `POST /admin/charges` (a charge recorded as is, for reconciliation drills) and of
/// `POST /admin/charges/{id}` (fields to overwrite).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChargeEdit {
    pub reference: Option<String>,
    pub amount: Option<i64>,
    pub currency: Option<String>,
    pub status: Option<crate::api::ChargeStatus>,
}

const CHARGE_COLUMNS: &str =
    "id, reference, amount, currency, status, idempotency_key, created_at, refunded_at";

/// `POST /admin/charges`: records a charge as given (reference, amount, currency, status), as if
/// the provider had made it without the caller knowing: a drill for reconciliation, which must
/// find it. No webhook is sent.
pub async fn create_charge(
    State(state): State<AppState>,
    Body(body): Body<ChargeEdit>,
) -> Result<Json<Charge>, ApiError> {
    let (Some(reference), Some(amount), Some(currency), Some(status)) =
        (body.reference, body.amount, body.currency, body.status)
    else {
        return Err(ApiError::BadRequest(
            "reference, amount, currency and status are required".into(),
        ));
    };
    if status == crate::api::ChargeStatus::Pending {
        return Err(ApiError::BadRequest(
            "a drill charge is decided: succeeded, declined or refunded".into(),
        ));
    }
    crate::charges::validate(&crate::api::ChargeRequest {
        amount,
        currency: currency.clone(),
        reference: reference.clone(),
    })?;
    let row: ChargeRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO provider.charges (id, reference, amount, currency, status, refunded_at)
         VALUES ($1, $2, $3, $4, $5, CASE WHEN $5 = 'refunded' THEN now() END)
         RETURNING {CHARGE_COLUMNS}"
    )))
    .bind(Uuid::now_v7())
    .bind(&reference)
    .bind(amount)
    .bind(&currency)
    .bind(status.as_str())
    .fetch_one(&state.pool)
    .await?;
    row.into_charge().map(Json)
}

/// `POST /admin/charges/{id}`: overwrites a charge's amount, currency or status (a drill: the
/// provider's record disagrees with what the caller was told).
pub async fn edit_charge(
    State(state): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
    Body(body): Body<ChargeEdit>,
) -> Result<Json<Charge>, ApiError> {
    let id = Uuid::parse_str(&id)
        .map_err(|_| ApiError::BadRequest("the charge id must be a UUID".into()))?;
    if body.reference.is_some() {
        return Err(ApiError::BadRequest(
            "the reference cannot be changed".into(),
        ));
    }
    if body.amount.is_some_and(|a| a <= 0) {
        return Err(ApiError::BadRequest("amount must be positive".into()));
    }
    if body
        .currency
        .as_ref()
        .is_some_and(|c| c.len() != 3 || !c.bytes().all(|b| b.is_ascii_uppercase()))
    {
        return Err(ApiError::BadRequest(
            "currency must be three capital letters".into(),
        ));
    }
    let row: Option<ChargeRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE provider.charges SET amount = coalesce($2, amount), currency = coalesce($3, currency),
             status = coalesce($4, status),
             refunded_at = CASE WHEN coalesce($4, status) = 'refunded' THEN coalesce(refunded_at, now()) END
         WHERE id = $1 RETURNING {CHARGE_COLUMNS}"
    )))
    .bind(id)
    .bind(body.amount)
    .bind(body.currency)
    .bind(body.status.map(|s| s.as_str()))
    .fetch_optional(&state.pool)
    .await?;
    match row {
        Some(row) => row.into_charge().map(Json),
        None => Err(ApiError::NotFound(format!("no charge {id}"))),
    }
}
