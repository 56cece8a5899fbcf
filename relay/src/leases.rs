//! Partition leases: which of the 64 outbox partitions this relay may publish.
//!
//! Each relay heartbeats in `relay_instances`, renews the leases it holds, and aims to hold its fair
//! share ([`plumbing::membership::fair_share`]: 64 / live relays, one more for the first ones by
//! id, so shares differ by at most one): it takes free or expired partitions when it holds fewer, and
//! gives back the surplus when it holds more, at a safe point between batches. A relay that dies
//! stops renewing; after the lease its partitions are expired and the others take them.
//!
//! A relay uses a partition only while its own (local, monotonic) view of the lease has at least a
//! confirm timeout left, and that view ends before the database's `lease_until`: two relays never
//! publish one partition at the same time unless the clocks lie or a pause outlasts the lease.

use crate::internal_events::readiness as set_ready;
use plumbing::telemetry::{ErrorChain, Readiness};
use shared::schema::Schema;
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub const PARTITIONS: i64 = 64;

/// The leases this relay holds, as seen locally.
#[derive(Debug)]
pub struct Leases {
    pub instance_id: String,
    schema: Schema,
    lease: Duration,
    /// Partition -> local instant until which it may be used.
    held: Mutex<BTreeMap<i16, Instant>>,
    /// How many partitions to give back at the next safe point.
    surplus: Mutex<usize>,
    /// Partitions taken over since the pipeline last asked ([`Self::take_taken`]): another
    /// relay may have worked them meanwhile.
    taken: Mutex<Vec<i16>>,
}

impl Leases {
    pub fn new(instance_id: String, schema: Schema, lease: Duration) -> Self {
        Self {
            instance_id,
            schema,
            lease,
            held: Mutex::new(BTreeMap::new()),
            surplus: Mutex::new(0),
            taken: Mutex::new(Vec::new()),
        }
    }

    /// Partitions usable for a batch that may take up to `need` (confirm timeout plus margin), and
    /// the earliest local lease end among them.
    pub fn usable(&self, need: Duration) -> (Vec<i16>, Instant) {
        let now = Instant::now();
        let held = self.held.lock().unwrap();
        let mut earliest = now + self.lease;
        let parts = held
            .iter()
            .filter(|(_, until)| **until > now + need)
            .map(|(p, until)| {
                earliest = earliest.min(*until);
                *p
            })
            .collect();
        (parts, earliest)
    }

    /// The product schema the partitions and the outbox live in.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    pub fn held_count(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    fn margin(&self) -> Duration {
        (self.lease / 5).min(Duration::from_secs(1))
    }

    /// One heartbeat: register, renew, rebalance. Called every lease/4.
    pub async fn tick(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let started = Instant::now();
        let lease_secs = self.lease.as_secs_f64();
        let mut tx = pool.begin().await?;
        sqlx::query(self.schema.sql(
            "INSERT INTO {{schema}}.relay_instances (instance_id, hostname) VALUES ($1, $2) \
             ON CONFLICT (instance_id) DO UPDATE SET heartbeat_at = now()",
        ))
        .bind(&self.instance_id)
        .bind(plumbing::membership::hostname())
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        let live: Vec<String> = sqlx::query_scalar(self.schema.sql(
            "SELECT instance_id FROM {{schema}}.relay_instances \
             WHERE heartbeat_at > now() - make_interval(secs => $1) ORDER BY instance_id",
        ))
        .bind(lease_secs)
        .persistent(false)
        .fetch_all(&mut *tx)
        .await?;
        let rank = live
            .iter()
            .position(|i| *i == self.instance_id)
            .unwrap_or(0);
        let fair = plumbing::membership::fair_share(PARTITIONS, live.len() as i64, rank as i64);

        let mut renewed: Vec<i16> = sqlx::query_scalar(
            self.schema.sql("UPDATE {{schema}}.relay_partitions SET lease_until = now() + make_interval(secs => $2) \
             WHERE owner = $1 RETURNING partition"),
        )
        .bind(&self.instance_id)
        .bind(lease_secs)
        .persistent(false)
        .fetch_all(&mut *tx)
        .await?;
        let missing = fair - renewed.len() as i64;
        if missing > 0 {
            let taken: Vec<i16> = sqlx::query_scalar(
                self.schema.sql("UPDATE {{schema}}.relay_partitions SET owner = $1, lease_until = now() + make_interval(secs => $2) \
                 WHERE partition IN ( \
                     SELECT partition FROM {{schema}}.relay_partitions \
                     WHERE owner IS NULL OR lease_until < now() \
                     ORDER BY partition LIMIT $3 FOR UPDATE SKIP LOCKED) \
                 RETURNING partition"),
            )
            .bind(&self.instance_id)
            .bind(lease_secs)
            .bind(missing)
            .persistent(false)
        .fetch_all(&mut *tx)
            .await?;
            if !taken.is_empty() {
                tracing::info!(partitions = ?taken, "took over partitions");
            }
            // Recorded before the commit: if it fails, forgetting the positions costs one read
            // from the start; not forgetting them could skip another relay's given-back rows.
            self.taken.lock().unwrap().extend(&taken);
            renewed.extend(taken);
        }
        // Forget relays gone for long (their partitions expired long ago).
        sqlx::query(
            self.schema.sql("DELETE FROM {{schema}}.relay_instances WHERE heartbeat_at < now() - make_interval(secs => $1 * 10)"),
        )
        .bind(lease_secs)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        // Only a committed renewal counts: the local view follows the commit.
        tx.commit().await?;
        let valid_until = started + self.lease - self.margin();
        {
            let mut held = self.held.lock().unwrap();
            held.clear();
            for p in &renewed {
                held.insert(*p, valid_until);
            }
        }
        *self.surplus.lock().unwrap() = (renewed.len() as i64 - fair).max(0) as usize;
        crate::internal_events::owned_partitions(renewed.len());
        Ok(())
    }

    /// The partitions taken over since the last call.
    pub fn take_taken(&self) -> Vec<i16> {
        std::mem::take(&mut *self.taken.lock().unwrap())
    }

    /// Local lease end of a partition, if held.
    pub fn valid_until(&self, partition: i16) -> Option<Instant> {
        self.held.lock().unwrap().get(&partition).copied()
    }

    /// Partitions to give back for rebalancing (the highest ones held), resetting the request.
    /// The caller stops claiming them and releases them once nothing of theirs is in flight.
    pub fn take_surplus(&self) -> Vec<i16> {
        let n = std::mem::take(&mut *self.surplus.lock().unwrap());
        self.held
            .lock()
            .unwrap()
            .keys()
            .rev()
            .take(n)
            .copied()
            .collect()
    }

    /// Releases partitions (or all of them, at shutdown) so another relay can take them at once.
    pub async fn release(&self, pool: &PgPool, partitions: &[i16]) -> Result<(), sqlx::Error> {
        {
            let mut held = self.held.lock().unwrap();
            for p in partitions {
                held.remove(p);
            }
        }
        let mut tx = pool.begin().await?;
        sqlx::query(self.schema.sql(
            "UPDATE {{schema}}.relay_partitions SET owner = NULL, lease_until = '-infinity' \
             WHERE owner = $1 AND partition = ANY($2)",
        ))
        .bind(&self.instance_id)
        .bind(partitions)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        crate::internal_events::owned_partitions(self.held_count());
        Ok(())
    }

    /// At shutdown: give everything back and leave the instance list.
    pub async fn release_all(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        self.held.lock().unwrap().clear();
        let mut tx = pool.begin().await?;
        sqlx::query(
            self.schema.sql("UPDATE {{schema}}.relay_partitions SET owner = NULL, lease_until = '-infinity' WHERE owner = $1"),
        )
        .bind(&self.instance_id)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            self.schema
                .sql("DELETE FROM {{schema}}.relay_instances WHERE instance_id = $1"),
        )
        .bind(&self.instance_id)
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        crate::internal_events::owned_partitions(0);
        Ok(())
    }
}

/// Renews (and rebalances) the leases every quarter lease, reporting PostgreSQL readiness, until
/// `stop`. New partitions may have a backlog, so gaining one wakes the pipeline.
pub(crate) async fn renew_loop(
    pool: PgPool,
    leases: Arc<Leases>,
    wake: Arc<Notify>,
    readiness: Arc<Readiness>,
    lease: Duration,
    stop: CancellationToken,
) {
    let period = lease / 4;
    loop {
        let before = leases.held_count();
        match plumbing::db::bounded(leases.tick(&pool)).await {
            Ok(()) => {
                set_ready(&readiness, Some(true), None);
                if leases.held_count() > before {
                    wake.notify_one(); // new partitions may have a backlog
                }
            }
            Err(e) => {
                set_ready(&readiness, Some(false), None);
                tracing::warn!(error = %ErrorChain(&e), "lease renewal failed; partitions are used only while the local lease view lasts");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.cancelled() => return,
        }
    }
}
