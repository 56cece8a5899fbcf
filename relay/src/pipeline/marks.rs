//! Confirmed rows on their way to being marked published (deleted, or kept for the retention).

use super::chains::Markable;
use crate::internal_events::{self, DbOp};
use crate::store;
use shared::schema::Schema;
use sqlx::PgPool;
use std::collections::HashSet;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A running mark.
type MarkTask = JoinHandle<Result<(), sqlx::Error>>;

#[derive(Default)]
pub(super) struct Marks {
    /// Confirmed rows waiting for their mark.
    waiting: Vec<i64>,
    /// Confirmed rows that had failed before: their partition may be unblocked once marked.
    retried: Vec<i64>,
    running: Option<(MarkTask, Vec<i64>)>,
}

impl Marks {
    pub fn push(&mut self, m: Markable) {
        self.waiting.push(m.seq);
        if m.retried {
            self.retried.push(m.seq);
        }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_none()
    }

    /// Every confirmed row not marked yet (they stay held when a link fails).
    pub fn unmarked(&self) -> HashSet<i64> {
        self.waiting
            .iter()
            .chain(self.running.iter().flat_map(|(_, seqs)| seqs.iter()))
            .copied()
            .collect()
    }

    /// Starts a mark of every waiting row, unless one runs.
    pub fn start(
        &mut self,
        pool: &PgPool,
        schema: &Schema,
        retain: bool,
        statements: store::Statements,
    ) {
        if self.running.is_some() || self.waiting.is_empty() {
            return;
        }
        let seqs = std::mem::take(&mut self.waiting);
        let (pool, schema, batch) = (pool.clone(), schema.clone(), seqs.clone());
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let done = plumbing::db::bounded(store::mark_published(
                &pool, &schema, &batch, retain, statements,
            ))
            .await;
            internal_events::db_duration(DbOp::Mark, started.elapsed());
            done
        });
        self.running = Some((task, seqs));
    }

    /// The running mark's task (the select waits on it).
    pub fn running(&mut self) -> Option<&mut MarkTask> {
        self.running.as_mut().map(|(task, _)| task)
    }

    /// The running mark ended: its rows, and those of them that had failed before.
    pub fn finished(&mut self, ok: bool) -> (Vec<i64>, Vec<i64>) {
        let Some((_, seqs)) = self.running.take() else {
            return (Vec::new(), Vec::new());
        };
        if !ok {
            self.waiting.extend(&seqs);
            return (seqs, Vec::new());
        }
        let done: HashSet<i64> = seqs.iter().copied().collect();
        let (now, later): (Vec<i64>, Vec<i64>) =
            self.retried.iter().partition(|s| done.contains(s));
        self.retried = later;
        (seqs, now)
    }

    /// Stops waiting for the running mark (at a stop past its deadline); returns how many rows
    /// stay unmarked.
    pub fn abandon(&mut self) -> usize {
        let running = self.running.take().map_or(0, |(task, seqs)| {
            task.abort();
            seqs.len()
        });
        running + self.waiting.len()
    }
}
