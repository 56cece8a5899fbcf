//! Per-aggregate chains: which claimed rows may go to the broker now, so that every aggregate's
//! rows reach its queues in order while many of them are in flight.
//!
//! RabbitMQ keeps the publish order of one channel in every queue, so an aggregate's rows are
//! published back to back, in seq order, without waiting for confirms. What can break the order is
//! a refusal (nack, return) of a row while later rows of its aggregate are in flight: those may
//! already be in a queue. The rules that keep what a consumer sees as strong as pipelining allows:
//!
//! - **Marks follow the acknowledged prefix.** A row is marked published only when it and every
//!   earlier row of its aggregate that was in flight are acknowledged. A later row acknowledged
//!   before an earlier one is refused is therefore still in the outbox, and is published again
//!   after the refused one.
//! - **A refusal rewinds the chain.** The refused row and everything after it go back to the
//!   outbox. Rows after it still in flight are *doomed*: whatever their confirm says, they are
//!   given back (never marked, never charged), and nothing more of the aggregate is sent, nor is
//!   its partition claimed, until they have settled.
//! - **A row that failed before is sent alone.** A row with attempts goes out only when nothing
//!   of its aggregate is in flight, and nothing after it is sent before it is acknowledged, so a
//!   refusal that repeats costs one row, not a window of duplicates.
//!
//! So after `1 2 3 4` where 3 is nacked while 4 is confirmed, a queue holds `1 2 4 3 4`: every
//! row's last copy is in order, and a consumer sees the gap (4 before 3) from `aggregate_seq`.

use crate::store::OutboxRow;
use std::collections::{HashMap, VecDeque};

/// The rows of every aggregate this relay holds, and which aggregates may send next.
#[derive(Default)]
pub(super) struct Chains {
    by_aggregate: HashMap<String, Chain>,
    /// Aggregates whose chain may send, in turn (round robin, so a hot aggregate does not starve
    /// the others of window).
    ready: VecDeque<String>,
    /// Partitions with doomed rows in flight (count of rewinding chains).
    rewinding: HashMap<i16, usize>,
}

struct Chain {
    partition: i16,
    /// Claimed, not sent yet, in seq order.
    queue: VecDeque<OutboxRow>,
    /// Sent and not settled, in send (= seq) order.
    in_flight: VecDeque<Sent>,
    /// Doomed rows among `in_flight`.
    doomed: usize,
    /// A row sent alone (it failed before) is in flight.
    solo: bool,
    /// Listed in `ready`.
    listed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sent {
    seq: i64,
    /// The row had failed before (attempts > 0): sent alone.
    retried: bool,
    acked: bool,
    /// Sent after a row of this chain that was refused: given back whatever its confirm says.
    doomed: bool,
}

/// A confirmed row the relay may now mark published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Markable {
    pub seq: i64,
    /// It had failed before, so its partition may be blocked on it in `relay_partitions`.
    pub retried: bool,
}

/// What an acknowledgement means for the rows of its chain.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Acked {
    /// These rows (the acknowledged prefix of the chain, possibly none yet) may be marked.
    Mark(Vec<Markable>),
    /// The row was doomed: it goes back to the outbox and is published again after the refused row.
    GiveBack,
}

impl Chain {
    fn new(partition: i16) -> Self {
        Self {
            partition,
            queue: VecDeque::new(),
            in_flight: VecDeque::new(),
            doomed: 0,
            solo: false,
            listed: false,
        }
    }

    fn can_send(&self) -> bool {
        let Some(next) = self.queue.front() else {
            return false;
        };
        if self.doomed > 0 || self.solo {
            return false;
        }
        next.attempts == 0 || self.in_flight.is_empty()
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty() && self.in_flight.is_empty()
    }

    /// Pops the acknowledged, undoomed prefix of `in_flight`.
    fn acked_prefix(&mut self) -> Vec<Markable> {
        let mut out = Vec::new();
        while let Some(s) = self.in_flight.front()
            && s.acked
            && !s.doomed
        {
            out.push(Markable {
                seq: s.seq,
                retried: s.retried,
            });
            self.in_flight.pop_front();
        }
        out
    }
}

impl Chains {
    /// Adds a claimed row behind the rows its aggregate already holds.
    pub fn add(&mut self, row: OutboxRow) {
        let key = row.aggregate_id.clone();
        self.by_aggregate
            .entry(key.clone())
            .or_insert_with(|| Chain::new(row.partition))
            .queue
            .push_back(row);
        self.list(&key);
    }

    /// The next aggregate that may send, with its partition (taken off the ready list: call
    /// [`Self::pop_next`] to send, or give its partition back).
    pub fn next_ready(&mut self) -> Option<(String, i16)> {
        while let Some(key) = self.ready.pop_front() {
            let Some(chain) = self.by_aggregate.get_mut(&key) else {
                continue;
            };
            chain.listed = false;
            if chain.can_send() {
                return Some((key, chain.partition));
            }
        }
        None
    }

    /// Takes the next row of `aggregate` to send; then report [`Self::sent`] or [`Self::skipped`].
    pub fn pop_next(&mut self, aggregate: &str) -> Option<OutboxRow> {
        let chain = self.by_aggregate.get_mut(aggregate)?;
        if !chain.can_send() {
            return None;
        }
        chain.queue.pop_front()
    }

    /// `row` (from [`Self::pop_next`]) is on the wire.
    pub fn sent(&mut self, row: &OutboxRow) {
        let Some(chain) = self.by_aggregate.get_mut(&row.aggregate_id) else {
            return;
        };
        let retried = row.attempts > 0;
        chain.solo |= retried;
        chain.in_flight.push_back(Sent {
            seq: row.seq,
            retried,
            acked: false,
            doomed: false,
        });
        self.list(&row.aggregate_id);
    }

    /// `row` (from [`Self::pop_next`]) was not sent (it went dead): its successors may go.
    pub fn skipped(&mut self, aggregate: &str) {
        self.list(aggregate);
        self.drop_if_empty(aggregate);
    }

    /// The broker acknowledged `row`.
    pub fn acked(&mut self, row: &OutboxRow) -> Acked {
        let Some(chain) = self.by_aggregate.get_mut(&row.aggregate_id) else {
            // Given back meanwhile (a link failure clears every chain): nothing to mark here.
            return Acked::Mark(vec![Markable {
                seq: row.seq,
                retried: row.attempts > 0,
            }]);
        };
        let Some(pos) = chain.in_flight.iter().position(|s| s.seq == row.seq) else {
            return Acked::Mark(Vec::new());
        };
        if chain.in_flight[pos].doomed {
            self.remove_doomed(&row.aggregate_id, pos);
            return Acked::GiveBack;
        }
        let sent = &mut chain.in_flight[pos];
        sent.acked = true;
        if sent.retried {
            chain.solo = false;
        }
        let markable = chain.acked_prefix();
        self.list(&row.aggregate_id);
        self.drop_if_empty(&row.aggregate_id);
        Acked::Mark(markable)
    }

    /// If `row` was doomed, takes it out of its chain and says so: it goes back to the outbox
    /// uncharged, whatever the broker said about it.
    pub fn take_doomed(&mut self, row: &OutboxRow) -> bool {
        let Some(chain) = self.by_aggregate.get(&row.aggregate_id) else {
            return false;
        };
        match chain.in_flight.iter().position(|s| s.seq == row.seq) {
            Some(pos) if chain.in_flight[pos].doomed => {
                self.remove_doomed(&row.aggregate_id, pos);
                true
            }
            _ => false,
        }
    }

    /// The broker refused `row`: it leaves its chain, and every row sent after it is doomed.
    /// Returns the rows that go back to the outbox at once (doomed rows already acknowledged).
    pub fn refused(&mut self, row: &OutboxRow) -> Vec<i64> {
        let key = &row.aggregate_id;
        let Some(chain) = self.by_aggregate.get_mut(key) else {
            return Vec::new();
        };
        let Some(pos) = chain.in_flight.iter().position(|s| s.seq == row.seq) else {
            return Vec::new();
        };
        if chain.in_flight[pos].retried {
            chain.solo = false;
        }
        chain.in_flight.remove(pos);
        let was_rewinding = chain.doomed > 0;
        let mut back = Vec::new();
        let mut kept = VecDeque::with_capacity(chain.in_flight.len());
        for (i, mut s) in chain.in_flight.drain(..).enumerate() {
            if i >= pos && !s.doomed {
                if s.acked {
                    back.push(s.seq);
                    continue;
                }
                s.doomed = true;
                chain.doomed += 1;
            }
            kept.push_back(s);
        }
        chain.in_flight = kept;
        let partition = chain.partition;
        if chain.doomed > 0 && !was_rewinding {
            *self.rewinding.entry(partition).or_default() += 1;
        }
        self.list(key);
        self.drop_if_empty(key);
        back
    }

    /// Gives back every unsent row of `partition`; returns their seqs.
    pub fn give_back_partition(&mut self, partition: i16) -> Vec<i64> {
        self.give_back(|chain| chain.partition == partition)
    }

    /// Gives back every unsent row (at shutdown); returns their seqs.
    pub fn give_back_unsent(&mut self) -> Vec<i64> {
        let back = self.give_back(|_| true);
        self.ready.clear();
        back
    }

    /// Forgets everything: the link failed and every unconfirmed row went back to the outbox.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Partitions that must not be claimed: a refused row's successors are still in flight there,
    /// and a claim would hand the refused row out ahead of them.
    pub fn rewinding(&self) -> impl Iterator<Item = i16> + '_ {
        self.rewinding.keys().copied()
    }

    /// Aggregates held (for tests and gauges).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_aggregate.len()
    }

    fn give_back(&mut self, which: impl Fn(&Chain) -> bool) -> Vec<i64> {
        let mut back = Vec::new();
        self.by_aggregate.retain(|_, chain| {
            if which(chain) {
                back.extend(chain.queue.drain(..).map(|r| r.seq));
            }
            !chain.is_empty()
        });
        back
    }

    fn remove_doomed(&mut self, key: &str, pos: usize) {
        let Some(chain) = self.by_aggregate.get_mut(key) else {
            return;
        };
        chain.in_flight.remove(pos);
        chain.doomed -= 1;
        if chain.doomed == 0 {
            let p = chain.partition;
            if let Some(n) = self.rewinding.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    self.rewinding.remove(&p);
                }
            }
        }
        self.list(key);
        self.drop_if_empty(key);
    }

    /// Puts `key` on the ready list if its chain may send and is not listed yet.
    fn list(&mut self, key: &str) {
        if let Some(chain) = self.by_aggregate.get_mut(key)
            && !chain.listed
            && chain.can_send()
        {
            chain.listed = true;
            self.ready.push_back(key.to_string());
        }
    }

    fn drop_if_empty(&mut self, key: &str) {
        if self.by_aggregate.get(key).is_some_and(Chain::is_empty) {
            self.by_aggregate.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn row(aggregate: &str, seq: i64, attempts: i32) -> OutboxRow {
        OutboxRow {
            seq,
            id: uuid::Uuid::nil(),
            aggregate_type: "t".into(),
            aggregate_id: aggregate.into(),
            aggregate_seq: seq,
            event_type: "e".into(),
            payload: "{}".into(),
            headers: Default::default(),
            created_at: Utc::now(),
            attempts,
            partition: (seq % 2) as i16,
        }
    }

    /// Sends everything that may go now, as the window does; returns the rows in send order.
    fn send_all(chains: &mut Chains) -> Vec<OutboxRow> {
        let mut out = Vec::new();
        while let Some((key, _)) = chains.next_ready() {
            if let Some(r) = chains.pop_next(&key) {
                chains.sent(&r);
                out.push(r);
            }
        }
        out
    }

    fn seqs(rows: &[OutboxRow]) -> Vec<i64> {
        rows.iter().map(|r| r.seq).collect()
    }

    fn marked(a: Acked) -> Vec<i64> {
        match a {
            Acked::Mark(m) => m.iter().map(|m| m.seq).collect(),
            Acked::GiveBack => panic!("given back"),
        }
    }

    #[test]
    fn one_aggregate_is_sent_back_to_back_in_order() {
        let mut c = Chains::default();
        for s in [2, 4, 6, 8] {
            c.add(row("hot", s, 0));
        }
        assert_eq!(seqs(&send_all(&mut c)), vec![2, 4, 6, 8]);
        assert!(c.next_ready().is_none());
    }

    #[test]
    fn aggregates_take_turns() {
        let mut c = Chains::default();
        for s in [1, 3, 5] {
            c.add(row("a", s, 0));
        }
        for s in [2, 4] {
            c.add(row("b", s, 0));
        }
        assert_eq!(seqs(&send_all(&mut c)), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn only_the_acknowledged_prefix_is_marked() {
        let mut c = Chains::default();
        let rows: Vec<_> = [1, 3, 5].iter().map(|s| row("a", *s, 0)).collect();
        for r in &rows {
            c.add(r.clone());
        }
        send_all(&mut c);
        assert_eq!(marked(c.acked(&rows[1])), Vec::<i64>::new());
        assert_eq!(marked(c.acked(&rows[2])), Vec::<i64>::new());
        assert_eq!(marked(c.acked(&rows[0])), vec![1, 3, 5]);
        assert_eq!(c.len(), 0, "a settled chain is dropped");
    }

    #[test]
    fn a_refusal_dooms_later_rows_and_stops_the_chain_and_its_partition() {
        let mut c = Chains::default();
        let rows: Vec<_> = [1, 3, 5, 7].iter().map(|s| row("a", *s, 0)).collect();
        for r in &rows[..3] {
            c.add(r.clone());
        }
        send_all(&mut c);
        // 5 was confirmed before 3 was nacked: it is not marked, and goes back with 3.
        assert_eq!(marked(c.acked(&rows[2])), Vec::<i64>::new());
        assert_eq!(c.refused(&rows[1]), vec![5]);
        // 1 is still in flight and unaffected; nothing is doomed after 3 (5 is already back).
        assert_eq!(c.rewinding().count(), 0);
        assert_eq!(marked(c.acked(&rows[0])), vec![1]);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn doomed_rows_in_flight_hold_the_partition_until_they_settle() {
        let mut c = Chains::default();
        let rows: Vec<_> = [1, 3, 5, 7].iter().map(|s| row("a", *s, 0)).collect();
        for r in &rows[..3] {
            c.add(r.clone());
        }
        send_all(&mut c);
        assert_eq!(c.refused(&rows[0]), Vec::<i64>::new());
        assert_eq!(c.rewinding().collect::<Vec<_>>(), vec![1]);
        c.add(rows[3].clone());
        assert!(
            c.next_ready().is_none(),
            "nothing is sent while doomed rows are in flight"
        );
        assert_eq!(c.acked(&rows[1]), Acked::GiveBack);
        assert!(
            c.take_doomed(&rows[2]),
            "a doomed row's nack is not its own refusal"
        );
        assert_eq!(c.rewinding().count(), 0);
        assert_eq!(seqs(&send_all(&mut c)), vec![7]);
    }

    #[test]
    fn a_row_that_failed_before_goes_alone() {
        let mut c = Chains::default();
        let retried = row("a", 1, 2);
        let next = row("a", 3, 0);
        c.add(retried.clone());
        c.add(next.clone());
        assert_eq!(
            seqs(&send_all(&mut c)),
            vec![1],
            "its successors wait for its confirm"
        );
        assert_eq!(
            c.acked(&retried),
            Acked::Mark(vec![Markable {
                seq: 1,
                retried: true
            }])
        );
        assert_eq!(seqs(&send_all(&mut c)), vec![3]);
    }

    #[test]
    fn a_retried_row_waits_for_the_rows_in_flight_before_it() {
        let mut c = Chains::default();
        let first = row("a", 1, 0);
        c.add(first.clone());
        send_all(&mut c);
        c.add(row("a", 3, 1));
        assert!(send_all(&mut c).is_empty());
        assert_eq!(marked(c.acked(&first)), vec![1]);
        assert_eq!(seqs(&send_all(&mut c)), vec![3]);
    }

    #[test]
    fn giving_a_partition_back_returns_only_its_unsent_rows() {
        let mut c = Chains::default();
        c.add(row("odd", 1, 0));
        let sent = send_all(&mut c);
        c.add(row("odd", 3, 0));
        c.add(row("even", 2, 0));
        c.add(row("even", 4, 0));
        assert_eq!(c.give_back_partition(1), vec![3]);
        assert_eq!(seqs(&send_all(&mut c)), vec![2, 4]);
        assert_eq!(marked(c.acked(&sent[0])), vec![1]);
    }

    #[test]
    fn a_skipped_row_lets_the_next_one_go() {
        let mut c = Chains::default();
        c.add(row("a", 1, 0));
        c.add(row("a", 3, 0));
        let (key, _) = c.next_ready().unwrap();
        let dead = c.pop_next(&key).unwrap();
        assert_eq!(dead.seq, 1);
        c.skipped(&key);
        assert_eq!(seqs(&send_all(&mut c)), vec![3]);
    }
}
