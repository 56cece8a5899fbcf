//! The payment process (kind `payment`): what happens after `POST /payments` accepted a payment.
//!
//! 1. `reserve_order` (local): the order is reserved for this payment (`demo.orders.reserved_by`).
//!    An order that is not payable (already reserved by another payment, paid, cancelled) is not
//!    reserved; the charge then refuses to run and the process compensates.
//!    Compensation `release`: the reservation is released (order back to `placed`), the payment
//!    `failed`, and `payment.failed` goes through the outbox, in one transaction.
//! 2. `charge` (external): the provider is called with the process's idempotency key (for
//!    [`Remote::HonoursKey`]) and the payment id as its stable reference; a decline is permanent,
//!    an unanswered call an unknown outcome (retried with the same key, or looked up by reference
//!    for [`Remote::Queryable`], or manual review for [`Remote::Neither`]).
//!    Compensation `refund` (**sensitive**: it waits in manual_review for an approver).
//! 3. `confirmation` (wait, version 2): in the provider's async mode the charge answers `202
//!    pending`; the process then waits (no lease, no connection) for the provider's webhook about
//!    the charge, which [`crate::provider_webhooks`] turns into [`processes::signal()`] for the key
//!    `charge:<charge id>` in the transaction of its inbox row. After
//!    `PAYMENT_CONFIRMATION_TIMEOUT` without it, the provider is asked (`GET /charges/{id}`):
//!    decided = taken as the event would be; still pending = asked again with the charge's retry
//!    policy, then manual review; unknown to the provider = manual review. A charge that was
//!    decided at once (sync mode) does not wait.
//! 4. `record_capture` (local): payment `succeeded`, order `paid`, `payment.captured` (the
//!    ledger's `account` and `amount`) in one transaction; or, for a charge the provider declined
//!    after accepting it (async), payment `failed`, order released, `payment.failed` (nothing
//!    was taken, so nothing to refund and no compensation). An order that is no longer reserved for
//!    this payment (cancelled meanwhile) fails the step permanently: the charge needs its refund.
//!    The charge id comes from the charge's output, or from the evidence of an operator who
//!    resolved the charge as succeeded (the provider's charge id).
//!
//! The API starts the process with [`start`] in the request's effect transaction; `producer
//! worker` runs it with [`definition`] and a provider [`Client`]. docs/payment-flow.md tells the
//! whole flow, each provider failure and how an operator resolves a review.
//!
//! Trace context: the processes crate does not carry one, so the request's `traceparent` travels
//! in the process input; each step runs in a span parented to it, and the events it writes carry
//! it, so `payment.captured` / `payment.failed` continue the request's trace.

use crate::internal_events;
use payment_provider::api::ChargeStatus;
use payment_provider::client::{ChargeError, Client, QueryError, RefundError};
use processes::{
    Action, Definition, Done, ExternalStep, LocalStep, Lookup, Remote, RetryPolicy, Started, Step,
    StepContext, StepError, StepFuture,
};
use serde::{Deserialize, Serialize};
use shared::NewMessage;
use shared::schema::Schema;
use sqlx::PgConnection;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;
use uuid::Uuid;

/// The process kind.
pub const KIND: &str = "payment";
/// The definition version new payments start with (2: the charge's confirmation is awaited).
pub const VERSION: i32 = 2;

/// The input of a payment process (everything the steps need; no card data).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentInput {
    pub payment_id: Uuid,
    pub order_id: Uuid,
    pub tenant: String,
    pub amount: i64,
    pub currency: String,
    /// The request's W3C trace context, continued by the steps and their events.
    pub traceparent: String,
}

/// How the payment process runs.
#[derive(Debug, Clone)]
pub struct PaymentFlow {
    /// The product schema (outbox, processes).
    pub schema: Schema,
    /// What the provider supports: must match `PROVIDER_IDEMPOTENCY` / `PROVIDER_STATUS_QUERY`.
    pub remote: Remote,
    /// The provider; `None` where processes are only started (the API), never run.
    pub provider: Option<Client>,
    /// Limit of one provider call (the step's outcome is unknown past it).
    pub call_timeout: Duration,
    /// Retries of the charge and the refund (and of the status queries after the confirmation's
    /// deadline).
    pub retry: RetryPolicy,
    /// How long a pending charge waits for its webhook before the provider is asked
    /// (`PAYMENT_CONFIRMATION_TIMEOUT`).
    pub confirmation_timeout: Duration,
    /// The provider as a dependency (its shared circuit and limits); `None` where processes are
    /// only started.
    pub dependency: Option<breaker::Dependency>,
}

/// The provider's name as a dependency (its circuit in the `dependencies` table).
pub const PROVIDER: &str = "provider";

impl PaymentFlow {
    /// A flow that only starts processes (the API): the steps are never run with it.
    pub fn starter(schema: Schema, remote: Remote) -> Self {
        Self {
            schema,
            remote,
            provider: None,
            call_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            confirmation_timeout: Duration::from_secs(60),
            dependency: None,
        }
    }

    /// The provider the external steps call.
    fn provider(&self) -> Result<&Client, StepError> {
        self.provider
            .as_ref()
            .ok_or_else(|| StepError::transient("no payment provider configured in this process"))
    }
}

/// Parses `honours_key`, `queryable` or `none` (the `PAYMENT_REMOTE` setting).
pub fn parse_remote(s: &str) -> Result<Remote, String> {
    Remote::parse(s).ok_or_else(|| format!("{s:?}: expected honours_key, queryable or none"))
}

/// The `payment` definition (version [`VERSION`]).
pub fn definition(flow: &PaymentFlow) -> Definition {
    definition_version(flow, VERSION)
}

/// The `payment` definitions a worker runs: the current one, and version 1 (no confirmation
/// step) for the processes started before it.
pub fn definitions(flow: &PaymentFlow) -> [Definition; 2] {
    [
        definition_version(flow, VERSION),
        definition_version(flow, 1),
    ]
}

fn definition_version(flow: &PaymentFlow, version: i32) -> Definition {
    let flow = Arc::new(flow.clone());
    // The step's own limit is a little above the client's, so the client classifies first.
    let step_timeout = flow.call_timeout + Duration::from_secs(1);
    let local_retry = RetryPolicy::default().max_attempts(10);
    // The amount is minor units of `currency`: the console shows 63.96 EUR, not 6396.
    let d = Definition::new(KIND, version)
        .money("amount", "currency")
        .step(
            Step::local("reserve_order", Reserve)
                .retry(local_retry)
                .compensate_as("release", Action::local(Release(flow.clone()))),
        )
        .step({
            let charge = Step::external("charge", flow.remote, Charge(flow.clone()))
                .retry(flow.retry)
                .timeout(step_timeout)
                .compensate_sensitive_as(
                    "refund",
                    Action::external(Remote::HonoursKey, Refund(flow.clone())),
                );
            match &flow.dependency {
                Some(provider) => charge.needs(provider.clone()),
                None => charge,
            }
        });
    let d = if version >= 2 {
        d.step(
            Step::wait(
                "confirmation",
                Remote::Queryable,
                flow.confirmation_timeout,
                Confirmation(flow.clone()),
            )
            .retry(flow.retry)
            .timeout(step_timeout),
        )
    } else {
        d
    };
    d.step(Step::local("record_capture", Record(flow.clone())).retry(local_retry))
}

/// Starts the payment process for `input` in the caller's transaction (business key = the
/// payment id: a second start returns the existing process). The future is `Send`
/// ([`processes::start_in`] takes the connection itself), as the API's handler needs.
pub async fn start(
    tx: &mut PgConnection,
    flow: &PaymentFlow,
    input: &PaymentInput,
) -> Result<Started, processes::Error> {
    let definition = definition(flow);
    let key = input.payment_id.to_string();
    processes::start_in(tx, &flow.schema, &definition, &key, input).await
}

fn input(ctx: &StepContext) -> Result<PaymentInput, StepError> {
    serde_json::from_value(ctx.input.clone())
        .map_err(|e| StepError::permanent(format!("payment input unreadable: {e}")))
}

/// The span of one step, a child of the request's trace.
fn step_span(ctx: &StepContext, input: &PaymentInput) -> tracing::Span {
    let span = tracing::info_span!(
        "payment_step",
        step = %ctx.step,
        role = ctx.role.as_str(),
        attempt = ctx.attempt,
        payment = %input.payment_id,
        process = %ctx.process_id,
        trace_id = tracing::field::Empty,
    );
    plumbing::trace::set_parent(&span, &input.traceparent);
    if let Some(id) = shared::trace::trace_id(Some(&input.traceparent)) {
        span.record("trace_id", id);
    }
    span
}

/// A step's body, given its input, run in the step's span (a child of the request's trace).
fn traced<'a, F, Fut>(ctx: &'a StepContext, body: F) -> StepFuture<'a, Done>
where
    F: FnOnce(PaymentInput) -> Fut + Send + 'a,
    Fut: Future<Output = Result<Done, StepError>> + Send + 'a,
{
    Box::pin(async move {
        let input = input(ctx)?;
        let span = step_span(ctx, &input);
        body(input).instrument(span).await
    })
}

/// The `traceparent` the step's events carry: the step's span when exported, else the request's.
fn event_traceparent(span: &tracing::Span, input: &PaymentInput) -> String {
    plumbing::trace::traceparent_of(span).unwrap_or_else(|| input.traceparent.clone())
}

async fn enqueue(
    tx: &mut PgConnection,
    flow: &PaymentFlow,
    input: &PaymentInput,
    event_type: &str,
    payload: serde_json::Value,
) -> Result<(), StepError> {
    let traceparent = event_traceparent(&tracing::Span::current(), input);
    let message = NewMessage::new("payment", input.payment_id.to_string(), event_type, payload)
        .with_header("traceparent", traceparent)
        .with_header("tenant", input.tenant.clone());
    shared::outbox::Outbox::new(flow.schema.clone())
        .enqueue(&mut *tx, &message)
        .await
        .map_err(|e| StepError::transient(format!("outbox: {e}")))?;
    Ok(())
}

/// Releases the order this payment holds (back to `placed`); answers how many rows: 0 when
/// the payment did not hold it.
async fn release_order(tx: &mut PgConnection, input: &PaymentInput) -> Result<u64, StepError> {
    Ok(sqlx::query(
        "UPDATE demo.orders SET status = 'placed', reserved_by = NULL \
         WHERE id = $1 AND status = 'reserved' AND reserved_by = $2",
    )
    .bind(input.order_id)
    .bind(input.payment_id)
    .execute(&mut *tx)
    .await?
    .rows_affected())
}

/// Fails the payment for `reason` and emits `payment.failed`, if it was still pending.
async fn fail_payment(
    tx: &mut PgConnection,
    flow: &PaymentFlow,
    input: &PaymentInput,
    reason: &str,
) -> Result<(), StepError> {
    let failed = sqlx::query(
        "UPDATE demo.payments SET status = 'failed', failure_reason = $2, updated_at = now() \
         WHERE id = $1 AND status = 'pending'",
    )
    .bind(input.payment_id)
    .bind(reason)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if failed == 1 {
        enqueue(
            tx,
            flow,
            input,
            "payment.failed",
            serde_json::json!({
                "payment_id": input.payment_id,
                "order_id": input.order_id,
                "tenant": input.tenant,
                "amount": input.amount,
                "currency": input.currency,
                "reason": reason,
            }),
        )
        .await?;
        internal_events::payment_settled("failed");
    }
    Ok(())
}

/// Step 1: reserve the order for this payment.
struct Reserve;

impl LocalStep for Reserve {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        traced(ctx, move |input| async move {
            let row: Option<(String, Option<Uuid>)> = sqlx::query_as(
                "SELECT status, reserved_by FROM demo.orders WHERE id = $1 AND tenant = $2 FOR UPDATE",
            )
            .bind(input.order_id)
            .bind(&input.tenant)
            .fetch_optional(&mut *tx)
            .await?;
            let reserved = match row {
                Some((status, _)) if status == "placed" => {
                    sqlx::query(
                        "UPDATE demo.orders SET status = 'reserved', reserved_by = $2 WHERE id = $1",
                    )
                    .bind(input.order_id)
                    .bind(input.payment_id)
                    .execute(&mut *tx)
                    .await?;
                    None
                }
                Some((status, by)) if status == "reserved" && by == Some(input.payment_id) => None,
                Some((status, _)) => Some(format!("order is {status}")),
                None => Some("order not found".to_string()),
            };
            Ok(match reserved {
                None => Done::new(format!("order {}", input.order_id))
                    .with_output(serde_json::json!({"reserved": true})),
                // Not payable: nothing to hold. The charge refuses and the process
                // compensates (the payment fails with this reason).
                Some(why) => Done::new(format!("order {} not reserved", input.order_id))
                    .with_output(serde_json::json!({"reserved": false, "why": why})),
            })
        })
    }
}

/// Compensation of step 1: release the reservation, fail the payment, emit `payment.failed`.
struct Release(Arc<PaymentFlow>);

impl LocalStep for Release {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        traced(ctx, move |input| async move {
            let released = release_order(tx, &input).await?;
            fail_payment(tx, &self.0, &input, &failure_reason(ctx)).await?;
            Ok(Done::new(format!(
                "order {} {}",
                input.order_id,
                if released == 1 {
                    "released"
                } else {
                    "was not held"
                }
            )))
        })
    }
}

/// Why the payment failed, as far as the compensation knows: the reservation's refusal, a
/// refunded charge, or a declined/failed charge.
fn failure_reason(ctx: &StepContext) -> String {
    if let Some(why) = ctx
        .outputs
        .get("reserve_order")
        .filter(|o| o["reserved"] == serde_json::json!(false))
        .and_then(|o| o["why"].as_str())
    {
        return format!("not payable: {why}");
    }
    if ctx.outputs.contains_key("charge") {
        return "charged, then refunded: the capture could not be recorded".into();
    }
    "the charge failed (declined or refused by the provider)".into()
}

/// Step 2: charge at the provider.
struct Charge(Arc<PaymentFlow>);

impl ExternalStep for Charge {
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done> {
        traced(ctx, move |input| async move {
            if let Some(reserve) = ctx.outputs.get("reserve_order")
                && reserve["reserved"] == serde_json::json!(false)
            {
                return Err(StepError::permanent(format!(
                    "not charged: {}",
                    reserve["why"].as_str().unwrap_or("order not payable")
                )));
            }
            let provider = self.0.provider()?;
            let reference = input.payment_id.to_string();
            match provider
                .charge(
                    &reference,
                    input.amount,
                    &input.currency,
                    ctx.idempotency_key.as_deref(),
                )
                .await
            {
                // Pending (async mode) is an accepted charge, not a capture: the
                // confirmation step waits for its outcome.
                Ok(charge) => Ok(charge_done(&charge.id.to_string(), charge.status)),
                Err(e) => Err(charge_failed(e)),
            }
        })
    }

    fn query<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Lookup> {
        Box::pin(async move {
            let input = input(ctx)?;
            let provider = self.0.provider()?;
            match provider
                .find_by_reference(&input.payment_id.to_string())
                .await
            {
                // Found: the charge exists (calling again could take money twice). A pending one
                // is not a capture: its status goes along, and the confirmation step waits.
                Ok(Some(c)) if c.status != ChargeStatus::Declined => {
                    Ok(Lookup::Found(charge_done(&c.id.to_string(), c.status)))
                }
                // A declined charge took nothing: calling again cannot take money twice.
                Ok(_) => Ok(Lookup::NotFound),
                Err(QueryError::QueryUnsupported) => Ok(Lookup::Inconclusive(
                    "the provider has no lookup by reference".into(),
                )),
                Err(e @ QueryError::Invalid { .. }) => Ok(Lookup::Inconclusive(e.to_string())),
                Err(e @ QueryError::Unavailable { .. }) => Err(StepError::transient(e.to_string())),
            }
        })
    }
}

/// A failed charge as the step's error: a decline or a refused request is final, an
/// unavailable provider is waited for (no attempt spent), an unanswered call is an unknown
/// outcome.
fn charge_failed(e: ChargeError) -> StepError {
    let message = e.to_string();
    match e {
        ChargeError::Declined { .. } | ChargeError::Invalid { .. } => StepError::permanent(message),
        ChargeError::Unavailable { retry_after, .. } => {
            StepError::unavailable(message).retry_after(retry_after)
        }
        ChargeError::OutcomeUnknown { .. } => StepError::unknown(message),
    }
}

fn charge_done(charge_id: &str, status: ChargeStatus) -> Done {
    Done::new(charge_id)
        .with_output(serde_json::json!({"charge_id": charge_id, "status": status.as_str()}))
}

/// The correlation key of a charge's outcome (what [`crate::provider_webhooks`] signals).
pub fn confirmation_key(charge_id: &str) -> String {
    format!("charge:{charge_id}")
}

/// Step 3 (version 2): waits for the charge's outcome unless the charge answered it at once.
struct Confirmation(Arc<PaymentFlow>);

/// A decided charge's outcome as the confirmation step's evidence: taken (`succeeded`, or
/// `refunded`: it was taken) or declined (nothing taken; `record_capture` fails the payment).
fn decided(charge_id: &str, status: ChargeStatus) -> Option<Done> {
    let declined = match status {
        ChargeStatus::Succeeded | ChargeStatus::Refunded => false,
        ChargeStatus::Declined => true,
        ChargeStatus::Pending => return None,
    };
    Some(Done::new(charge_id).with_output(serde_json::json!({
        "charge_id": charge_id,
        "status": status.as_str(),
        "declined": declined,
    })))
}

/// The charge's id and status: from its output, or, for a charge an operator resolved as
/// succeeded, from the evidence they gave (the provider's charge id; their decision is the status).
fn charge_output(ctx: &StepContext) -> Result<(String, Option<ChargeStatus>), StepError> {
    if let Some(out) = ctx.outputs.get("charge")
        && let Some(id) = out["charge_id"].as_str()
    {
        return Ok((
            id.to_string(),
            out["status"].as_str().and_then(ChargeStatus::parse),
        ));
    }
    ctx.references
        .get("charge")
        .map(|id| (id.clone(), Some(ChargeStatus::Succeeded)))
        .ok_or_else(|| StepError::permanent("the charge left no charge id"))
}

impl processes::WaitStep for Confirmation {
    fn key(&self, ctx: &StepContext) -> Result<String, StepError> {
        Ok(confirmation_key(&charge_output(ctx)?.0))
    }

    fn already(&self, ctx: &StepContext) -> Option<Result<Done, StepError>> {
        match charge_output(ctx) {
            Ok((id, Some(status))) => decided(&id, status).map(Ok),
            // A version-1 style output without a status cannot say: wait, then ask.
            Ok((_, None)) => None,
            Err(e) => Some(Err(e)),
        }
    }

    fn received(
        &self,
        _ctx: &StepContext,
        key: &str,
        payload: &serde_json::Value,
    ) -> Result<Done, StepError> {
        let id = key.trim_start_matches("charge:");
        payload["status"]
            .as_str()
            .and_then(ChargeStatus::parse)
            .and_then(|s| decided(id, s))
            .ok_or_else(|| {
                StepError::unknown(format!("the event for {key} decides nothing: {payload}"))
            })
    }

    fn query<'a>(&'a self, _ctx: &'a StepContext, key: &'a str) -> StepFuture<'a, Lookup> {
        Box::pin(async move {
            let provider = self.0.provider()?;
            let id = key
                .trim_start_matches("charge:")
                .parse::<Uuid>()
                .map_err(|_| StepError::permanent(format!("{key} names no charge id")))?;
            match provider.get_charge(id).await {
                Ok(Some(c)) => match decided(&c.id.to_string(), c.status) {
                    Some(done) => Ok(Lookup::Found(done)),
                    None => Err(StepError::unknown(
                        "the charge is still pending at the provider",
                    )),
                },
                Ok(None) => Ok(Lookup::NotFound),
                Err(e @ QueryError::Unavailable { .. }) => Err(StepError::transient(e.to_string())),
                Err(e) => Ok(Lookup::Inconclusive(e.to_string())),
            }
        })
    }
}

/// Compensation of step 2 (sensitive): refund the charge.
struct Refund(Arc<PaymentFlow>);

impl ExternalStep for Refund {
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done> {
        traced(ctx, move |_| async move {
            let provider = self.0.provider()?;
            let charge = ctx
                .compensates
                .as_ref()
                .and_then(|d| d.reference.parse::<Uuid>().ok())
                .ok_or_else(|| {
                    StepError::permanent("the charge to refund has no readable charge id")
                })?;
            let refund = provider.refund(charge).await.map_err(refund_failed)?;
            Ok(Done::new(refund.id.to_string()))
        })
    }
}

/// A failed refund as the step's error, classified as [`charge_failed`] does.
fn refund_failed(e: RefundError) -> StepError {
    let message = e.to_string();
    match e {
        RefundError::NotFound | RefundError::NotRefundable { .. } | RefundError::Invalid { .. } => {
            StepError::permanent(message)
        }
        RefundError::Unavailable { retry_after, .. } => {
            StepError::unavailable(message).retry_after(retry_after)
        }
        RefundError::OutcomeUnknown { .. } => StepError::unknown(message),
    }
}

/// The provider declined the charge after accepting it (async mode): nothing was taken, so the
/// payment fails, the order is released and `payment.failed` goes out, in the step's transaction.
async fn declined(
    tx: &mut PgConnection,
    flow: &PaymentFlow,
    input: &PaymentInput,
) -> Result<Done, StepError> {
    release_order(tx, input).await?;
    fail_payment(tx, flow, input, "the charge was declined by the provider").await?;
    Ok(Done::new(format!(
        "payment {} failed: declined",
        input.payment_id
    )))
}

/// The last step: payment succeeded, order paid, `payment.captured`, in one transaction (or the
/// payment failed, after a declined confirmation).
struct Record(Arc<PaymentFlow>);

impl LocalStep for Record {
    fn run<'a>(&'a self, ctx: &'a StepContext, tx: &'a mut PgConnection) -> StepFuture<'a, Done> {
        traced(ctx, move |input| async move {
            if ctx
                .outputs
                .get("confirmation")
                .is_some_and(|o| o["declined"] == serde_json::json!(true))
            {
                return declined(tx, &self.0, &input).await;
            }
            // The charge's output, or, for a charge an operator resolved as succeeded, the
            // evidence they gave (the provider's charge id).
            let charge_id = ctx
                .outputs
                .get("charge")
                .and_then(|o| o["charge_id"].as_str())
                .or_else(|| ctx.references.get("charge").map(String::as_str))
                .ok_or_else(|| StepError::permanent("the charge left no charge id"))?
                .to_string();
            let order: Option<(String, Option<Uuid>)> = sqlx::query_as(
                "SELECT status, reserved_by FROM demo.orders WHERE id = $1 FOR UPDATE",
            )
            .bind(input.order_id)
            .fetch_optional(&mut *tx)
            .await?;
            match order {
                Some((status, by)) if status == "reserved" && by == Some(input.payment_id) => {}
                Some((status, _)) => {
                    return Err(StepError::permanent(format!(
                        "charged, but the order is {status} now: the capture cannot be recorded"
                    )));
                }
                None => return Err(StepError::permanent("charged, but the order is gone")),
            }
            sqlx::query("UPDATE demo.orders SET status = 'paid' WHERE id = $1")
                .bind(input.order_id)
                .execute(&mut *tx)
                .await?;
            let updated = sqlx::query(
                "UPDATE demo.payments SET status = 'succeeded', charge_id = $2, updated_at = now() \
                 WHERE id = $1 AND status = 'pending'",
            )
            .bind(input.payment_id)
            .bind(&charge_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if updated != 1 {
                return Err(StepError::permanent(
                    "charged, but the payment is no longer pending",
                ));
            }
            enqueue(
                tx,
                &self.0,
                &input,
                "payment.captured",
                serde_json::json!({
                    "payment_id": input.payment_id,
                    "order_id": input.order_id,
                    "account": format!("{}:{}", input.tenant, input.currency),
                    "amount": input.amount,
                    "currency": input.currency,
                    "charge_id": charge_id,
                }),
            )
            .await?;
            internal_events::payment_settled("succeeded");
            Ok(Done::new(format!("payment {} captured", input.payment_id)))
        })
    }
}
