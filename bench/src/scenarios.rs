//! The scenarios: one list ([`Scenario`]), one file each (`*_scenario.rs`), and the message
//! helpers they share. Each stops by itself; sizes scale with `--scale`.

use crate::env::BenchEnv;
use crate::report::Line;
use shared::NewMessage;

/// Ceilings measured earlier in this run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Ceilings {
    pub amqp: Option<f64>,
    pub pg: Option<f64>,
    pub raw_consume: Option<f64>,
}
/// Every scenario, in the order a full run takes them: the one list (the command line's names
/// come from it, kebab-case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    CeilingAmqp,
    CeilingPg,
    RelayDrain,
    RelaySkew,
    RelayLatency,
    ProducerInsert,
    Consumer,
    ConsumerOrdered,
    ConsumerOrderedScale,
    WebhookIngest,
    EndToEnd,
    Api,
    SoakMemory,
    TableGrowth,
    Processes,
    ProcessesWaiting,
    DependencyOutage,
    FairShare,
    OldSnapshot,
    Reconciliation,
}

impl Scenario {
    /// All of them, in run order.
    pub fn all() -> &'static [Scenario] {
        <Self as clap::ValueEnum>::value_variants()
    }

    /// The name on the command line and in the report (`relay-drain`).
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    /// Runs it; the ceiling scenarios record what later ones compare with in `c`.
    pub async fn run(self, env: &BenchEnv, c: &mut Ceilings) -> anyhow::Result<Vec<Line>> {
        use crate::*;
        match self {
            Scenario::CeilingAmqp => ceiling_scenario::ceiling_amqp(env, c).await,
            Scenario::CeilingPg => ceiling_scenario::ceiling_pg(env, c).await,
            Scenario::RelayDrain => relay_scenario::relay_drain(env, c).await,
            Scenario::RelaySkew => skew_scenario::relay_skew(env, c).await,
            Scenario::RelayLatency => latency_scenario::relay_latency(env).await,
            Scenario::ProducerInsert => producer_insert_scenario::producer_insert(env).await,
            Scenario::Consumer => consumer_scenario::consumer(env, c).await,
            Scenario::ConsumerOrdered => ordered_scenario::consumer_ordered(env).await,
            Scenario::ConsumerOrderedScale => ordered_scenario::consumer_ordered_scale(env).await,
            Scenario::WebhookIngest => webhook_scenario::webhook_ingest(env).await,
            Scenario::EndToEnd => latency_scenario::end_to_end(env).await,
            Scenario::Api => api_scenario::api(env).await,
            Scenario::SoakMemory => table_scenario::soak_memory(env).await,
            Scenario::TableGrowth => table_scenario::table_growth(env).await,
            Scenario::Processes => process_scenario::run(env).await,
            Scenario::ProcessesWaiting => waiting_scenario::processes_waiting(env).await,
            Scenario::DependencyOutage => outage_scenario::dependency_outage(env).await,
            Scenario::FairShare => fair_scenario::fair_share(env).await,
            Scenario::OldSnapshot => snapshot_scenario::old_snapshot(env).await,
            Scenario::Reconciliation => reconciliation_scenario::reconciliation(env).await,
        }
    }
}

/// The median of repeated measurements (0 for none): what the scenarios that measure more than
/// once report, so one noisy sample on a shared machine does not decide a ratio.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A ~208-byte JSON payload, like the reference figures.
pub fn payload(i: u64) -> serde_json::Value {
    serde_json::json!({
        "account": format!("acct-{:05}", i % 1000),
        "amount": (i % 997) as i64 + 1,
        "currency": "EUR",
        "reference": format!("bench-{i:012}"),
        "note": "a payload of about two hundred bytes, the size the reference figures used for every run"
    })
}

pub(crate) fn messages(from: u64, n: u64, aggregates: u64, event_type: &str) -> Vec<NewMessage> {
    (from..from + n)
        .map(|i| {
            NewMessage::new(
                "bench",
                format!("agg-{}", i % aggregates),
                event_type,
                payload(i),
            )
        })
        .collect()
}

/// The rows of step `i` of producer `p`: each producer writes its own 1,000 aggregates, as
/// services do when each business flow owns its aggregates (several producers hammering the same
/// aggregate in the same millisecond would measure the per-aggregate confirm chain instead).
pub(crate) fn producer_messages(p: u64, i: u64, rows: u64, event_type: &str) -> Vec<NewMessage> {
    (0..rows)
        .map(|k| {
            let n = p * 1_000_000_000 + i * 10 + k;
            NewMessage::new(
                "bench",
                format!("p{p}-agg-{}", (i * 10 + k) % 1000),
                event_type,
                payload(n),
            )
        })
        .collect()
}

/// Inserts `n` rows, 1000 per statement, in as few transactions as `per_tx` allows.
pub(crate) async fn fill_outbox(
    env: &BenchEnv,
    n: u64,
    aggregates: u64,
    event_type: &str,
) -> anyhow::Result<()> {
    let mut done = 0;
    while done < n {
        let mut tx = env.pool.begin().await?;
        let tx_end = (done + 100_000).min(n);
        while done < tx_end {
            let k = (tx_end - done).min(1000);
            shared::outbox::enqueue_many(&mut *tx, &messages(done, k, aggregates, event_type))
                .await?;
            done += k;
        }
        tx.commit().await?;
    }
    Ok(())
}

/// 1 while any row is pending, else 0: an index probe, so polling it does not load PostgreSQL.
pub(crate) async fn pending(env: &BenchEnv) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM outbox.messages WHERE state = 'pending' LIMIT 1) t",
    )
    .fetch_one(&env.pool)
    .await?)
}
