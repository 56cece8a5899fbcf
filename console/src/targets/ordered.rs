//! Ordered consumers: their partitions, their stuck aggregates (parked heads, gaps waited on too
//! long) with the messages held behind them, and the operator's three actions, through
//! `consumer::ordered::admin` on the consumer's tables (in the console's database and schema,
//! where the consumers of `CONSOLE_CONSUMERS` keep them).
//!
//! - **retry** (operator, runs now): the parked head is tried again. Nothing is discarded; if it
//!   fails again it parks again.
//! - **skip** (four eyes): the head is dead-lettered (or a missing number passed over) and the
//!   aggregate goes on without it. An effect is never applied: a second person approves.
//! - **dead-letter run** (four eyes): the head and everything held behind it are dead-lettered.
//!
//! An action names the aggregate and the position the operator saw (`version`, the applied
//! sequence number). The effect locks the aggregate's partition, checks the position and commits
//! with its audit entry in the console's transaction; a position that moved answers 409, and a
//! pending request on it is closed as `superseded` ([`crate::actions::approvals::supersede_stale`]). A
//! dead letter is confirmed by the broker before the position moves: an interruption in between
//! leaves a copy in the DLQ of a message still held, never a loss.

use crate::config::Settings;
use crate::error::ConsoleError;
use crate::redact;
use crate::targets::Change;
use consumer::error::AdminError;
use consumer::ordered::admin::{self, Discard, Target};
use consumer::ordered::store::AggregateKey;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use shared::schema::Schema;
use sqlx::{PgConnection, PgPool};
use std::time::Duration;
use utoipa::ToSchema;

/// How many held messages the console shows per stuck aggregate.
const HELD_SHOWN: i64 = 5;

/// An operator's action on a stuck aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OrderedAction {
    /// Try the parked head again now.
    Retry,
    /// Dead-letter the head (or pass a missing number over) and go on.
    Skip,
    /// Dead-letter the head and everything held behind it.
    DeadLetterRun,
}

impl OrderedAction {
    pub const ALL: [OrderedAction; 3] = [
        OrderedAction::Retry,
        OrderedAction::Skip,
        OrderedAction::DeadLetterRun,
    ];

    /// The name in URLs.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderedAction::Retry => "retry",
            OrderedAction::Skip => "skip",
            OrderedAction::DeadLetterRun => "dead_letter_run",
        }
    }

    /// The name in the audit log.
    pub fn audit_name(self) -> &'static str {
        match self {
            OrderedAction::Retry => "ordered.retry",
            OrderedAction::Skip => "ordered.skip",
            OrderedAction::DeadLetterRun => "ordered.dead_letter_run",
        }
    }

    /// Whether a second person must approve it: every action that discards.
    pub fn needs_approval(self) -> bool {
        self.discard().is_some()
    }

    /// What it discards, if it does.
    pub fn discard(self) -> Option<Discard> {
        match self {
            OrderedAction::Retry => None,
            OrderedAction::Skip => Some(Discard::Head),
            OrderedAction::DeadLetterRun => Some(Discard::Run),
        }
    }
}

impl std::str::FromStr for OrderedAction {
    type Err = ConsoleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OrderedAction::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| ConsoleError::NotFound(format!("ordered action {s:?}")))
    }
}

/// The body of an action.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AggregateAction {
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// The applied position seen (the aggregate's `version` in the listing).
    pub version: i64,
    pub reason: String,
    #[serde(default)]
    pub dry_run: bool,
}

impl AggregateAction {
    pub fn key(&self) -> AggregateKey {
        AggregateKey {
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
        }
    }

    /// The audit target: `ordered:<consumer>/<aggregate_type>/<aggregate_id>`.
    pub fn target(&self, consumer: &str) -> String {
        target(consumer, &self.aggregate_type, &self.aggregate_id)
    }
}

fn target(consumer: &str, aggregate_type: &str, aggregate_id: &str) -> String {
    format!("ordered:{consumer}/{aggregate_type}/{aggregate_id}")
}

/// A held message as shown (payload redacted).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HeldView {
    pub aggregate_seq: i64,
    pub message_id: String,
    pub event_type: String,
    pub payload: Value,
    pub held_at: String,
}

/// A stuck aggregate as shown.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StuckView {
    /// `parked` or `gap`.
    pub kind: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// The applied position: the version to send with an action.
    pub version: i64,
    pub head_message_id: Option<String>,
    pub reason: Option<String>,
    pub attempts: i32,
    pub held: i64,
    pub since: String,
    /// The first held messages, head first.
    pub first_held: Vec<HeldView>,
}

/// A partition as shown.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PartitionView {
    pub partition: i16,
    pub owner: Option<String>,
    pub epoch: i64,
    pub live: bool,
    pub lease_until: String,
    pub aggregates: i64,
    pub held: i64,
}

/// An ordered consumer as the console shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ConsumerView {
    pub consumer: String,
    pub parked: i64,
    pub gap_waits: i64,
    pub held: i64,
    pub partitions: Vec<PartitionView>,
    pub stuck: Vec<StuckView>,
}

/// `consumer`'s partitions and its stuck aggregates (gaps count once older than `gap_after`).
pub async fn view(
    pool: &PgPool,
    schema: &shared::schema::Schema,
    consumer: &str,
    gap_after: Duration,
) -> Result<ConsumerView, ConsoleError> {
    let partitions = admin::partitions(pool, schema, consumer).await?;
    if partitions.is_empty() {
        return Err(ConsoleError::NotFound(format!(
            "ordered consumer {consumer:?} (no instance of it in ordered mode has run here)"
        )));
    }
    let (parked, gap_waits, held) = admin::counts(pool, schema, consumer, gap_after).await?;
    let mut stuck = Vec::new();
    for s in admin::stuck(pool, schema, consumer, gap_after, 200).await? {
        let key = AggregateKey {
            aggregate_type: s.aggregate_type.clone(),
            aggregate_id: s.aggregate_id.clone(),
        };
        let first_held = admin::held(pool, schema, consumer, &key, None, HELD_SHOWN)
            .await?
            .into_iter()
            .map(|h| HeldView {
                aggregate_seq: h.aggregate_seq,
                message_id: h.message_id.to_string(),
                event_type: redact::text(&h.event_type),
                payload: redact::value(&h.payload),
                held_at: h.held_at.to_rfc3339(),
            })
            .collect();
        stuck.push(StuckView {
            kind: match s.kind {
                admin::StuckKind::Parked => "parked",
                admin::StuckKind::Gap => "gap",
            }
            .into(),
            aggregate_type: redact::text(&s.aggregate_type),
            aggregate_id: redact::text(&s.aggregate_id),
            version: s.applied_seq,
            head_message_id: s.head_message_id.map(|m| m.to_string()),
            reason: s.reason.as_deref().map(redact::text),
            attempts: s.attempts,
            held: s.held,
            since: s.since.to_rfc3339(),
            first_held,
        });
    }
    Ok(ConsumerView {
        consumer: consumer.to_string(),
        parked,
        gap_waits,
        held,
        partitions: partitions
            .into_iter()
            .map(|p| PartitionView {
                partition: p.partition,
                owner: p.owner.as_deref().map(redact::text),
                epoch: p.epoch,
                live: p.live,
                lease_until: p.lease_until.to_rfc3339(),
                aggregates: p.aggregates,
                held: p.held,
            })
            .collect(),
        stuck,
    })
}

impl From<AdminError> for ConsoleError {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::NoSuchAggregate => {
                ConsoleError::NotFound("aggregate (it has no position for this consumer)".into())
            }
            AdminError::NotParked | AdminError::NothingHeld | AdminError::Moved { .. } => {
                ConsoleError::Conflict(e.to_string())
            }
            AdminError::DeadLetterRefused(_) | AdminError::Amqp(_) => {
                ConsoleError::Broker(plumbing::telemetry::ErrorChain(&e).to_string())
            }
            AdminError::Db(e) => ConsoleError::Db(e),
        }
    }
}

/// The request kept for the second person, and what runs on approval.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DiscardRequest {
    pub consumer: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// The applied position seen; the approval runs only while it is still the same.
    pub version: i64,
    pub discard: Discard,
    /// The numbers it would dead-letter when it was asked (shown to the approver).
    pub would_dead_letter: Vec<i64>,
    /// The held messages it would dead-letter, as they were when asked (redacted).
    #[serde(default)]
    pub messages: Vec<Value>,
}

impl DiscardRequest {
    pub fn target(&self) -> String {
        target(&self.consumer, &self.aggregate_type, &self.aggregate_id)
    }

    fn key(&self) -> AggregateKey {
        AggregateKey {
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
        }
    }
}

/// Retries a parked head on `conn` (the action's transaction).
pub async fn retry(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    body: &AggregateAction,
) -> Result<(Vec<Change>, Value), ConsoleError> {
    let key = body.key();
    let target = Target {
        consumer,
        key: &key,
        seen: Some(body.version),
    };
    let resolved = admin::retry_head(conn, schema, &target).await?;
    let after = json!({"applied_seq": resolved.applied_seq, "parked": false, "retry": "now"});
    Ok((
        vec![Change {
            target: body.target(consumer),
            before: Some(json!({"applied_seq": body.version, "parked": true})),
            after: Some(after.clone()),
            ..Default::default()
        }],
        after,
    ))
}

/// Checks that `action` can discard now, on the position seen, and returns the request a second
/// person will approve (or the dry run's answer). Locks like the effect, on `conn`.
pub async fn request(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    discard: Discard,
    body: &AggregateAction,
) -> Result<DiscardRequest, ConsoleError> {
    let key = body.key();
    let target = Target {
        consumer,
        key: &key,
        seen: Some(body.version),
    };
    let plan = admin::preview(conn, schema, &target, discard).await?;
    let messages = held_messages(conn, schema, consumer, &key, &plan.dead_letter).await?;
    Ok(DiscardRequest {
        consumer: consumer.to_string(),
        aggregate_type: body.aggregate_type.clone(),
        aggregate_id: body.aggregate_id.clone(),
        version: body.version,
        discard,
        would_dead_letter: plan.dead_letter,
        messages,
    })
}

/// What a discard would dead-letter, as the request shows it (at most 20, payloads redacted).
async fn held_messages(
    conn: &mut PgConnection,
    schema: &Schema,
    consumer: &str,
    key: &AggregateKey,
    seqs: &[i64],
) -> Result<Vec<Value>, ConsoleError> {
    let held = admin::held(&mut *conn, schema, consumer, key, Some(seqs), 20).await?;
    Ok(held
        .into_iter()
        .map(|m| {
            json!({
                "aggregate_seq": m.aggregate_seq,
                "message_id": m.message_id,
                "event_type": m.event_type,
                "payload": redact::value(&m.payload),
            })
        })
        .collect())
}

/// The approved effect: dead-letters what the request names (confirmed by the broker), then
/// moves the position, on `conn` (the approving transaction, committed with the audit entries).
pub async fn discard(
    conn: &mut PgConnection,
    schema: &Schema,
    settings: &Settings,
    request: &DiscardRequest,
    reason: &str,
) -> Result<(Vec<Change>, Value), ConsoleError> {
    let key = request.key();
    let target = Target {
        consumer: &request.consumer,
        key: &key,
        seen: Some(request.version),
    };
    let amqp = plumbing::amqp_nodes::connect(
        &settings.amqp_url,
        &settings.amqp_tls,
        &format!("console ordered {}", request.consumer),
    )
    .await
    .map_err(|e| ConsoleError::Broker(plumbing::telemetry::ErrorChain(&e).to_string()))?;
    let result = async {
        let channel = amqp.create_channel().await.map_err(AdminError::from)?;
        channel
            .confirm_select(Default::default())
            .await
            .map_err(AdminError::from)?;
        admin::dead_letter(conn, schema, &channel, &target, reason, request.discard).await
    }
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(5), amqp.close(200, "done".into())).await;
    let resolved = result?;
    let after = json!({
        "applied_seq": resolved.applied_seq,
        "dead_lettered": resolved.dead_lettered,
        "dead_letter_queue": format!("{}.dlq", request.consumer),
    });
    Ok((
        vec![Change {
            target: request.target(),
            before: Some(json!({
                "applied_seq": request.version,
                "held": request.messages,
            })),
            after: Some(after.clone()),
            ..Default::default()
        }],
        after,
    ))
}
