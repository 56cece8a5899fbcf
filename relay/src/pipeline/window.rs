//! The publishes in flight: their confirms, how many more may go, and what each confirm means.

use crate::internal_events::{self, FailureReason};
use crate::store::OutboxRow;
use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use lapin::Confirmation;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::time::Instant;

pub(super) type ConfirmResult =
    Result<Result<Confirmation, lapin::Error>, tokio::time::error::Elapsed>;
pub(super) type ConfirmFuture =
    Pin<Box<dyn Future<Output = (OutboxRow, ConfirmResult, Instant)> + Send>>;

/// Longest the relay publishes one row at a time to find the row the broker refused.
const ISOLATION_LIMIT: Duration = Duration::from_secs(60);

/// What a confirm says about its row.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// In the broker's hands.
    Ack,
    /// The broker refused this row (nack, or returned as unroutable): charge it.
    Refused { reason: FailureReason, why: String },
    /// The broker closed the channel over a message (which one is not known if several were in
    /// flight).
    ChannelClosed(String),
    /// The link failed (or went silent): nothing is charged.
    LinkFailed { reason: FailureReason, why: String },
}

/// Reads one confirm. `returned`: the reason if the broker returned this row's message.
pub(super) fn verdict(
    result: ConfirmResult,
    returned: Option<String>,
    timeout: Duration,
) -> Verdict {
    match result {
        Ok(Ok(Confirmation::Ack(_))) => match returned {
            Some(why) => Verdict::Refused {
                reason: FailureReason::Unroutable,
                why,
            },
            None => Verdict::Ack,
        },
        Ok(Ok(Confirmation::Nack(_))) => Verdict::Refused {
            reason: FailureReason::Nack,
            why: "nacked by broker".into(),
        },
        Ok(Ok(Confirmation::NotRequested)) => Verdict::LinkFailed {
            reason: FailureReason::Connection,
            why: "channel not in confirm mode".into(),
        },
        Ok(Err(e)) => match broker_refusal(&e) {
            Some(why) => Verdict::ChannelClosed(why),
            None => Verdict::LinkFailed {
                reason: FailureReason::Connection,
                why: e.to_string(),
            },
        },
        // A timeout is the link's (a quorum queue without a leader, a stalled path), not the
        // row's: charging it would kill rows during an outage. The culprits that do exist,
        // refusals, close the channel right after the body arrives, well within it.
        Err(_) => Verdict::LinkFailed {
            reason: FailureReason::ConfirmTimeout,
            why: format!("no confirm within {timeout:?}"),
        },
    }
}

/// The reason, when the broker closed the channel or connection over a message it refused
/// (PRECONDITION_FAILED such as a message over `max_message_size`, a frame or syntax error) rather
/// than over the link, its topology or its permissions (those are retried without charging a row).
fn broker_refusal(e: &lapin::Error) -> Option<String> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.get_id(), 406 | 501 | 502 | 503 | 505) =>
        {
            Some(format!(
                "refused by the broker: {} {}",
                amqp.get_id(),
                amqp.get_message().as_str()
            ))
        }
        _ => None,
    }
}

/// The broker closed the channel over a message, and several were in flight: until each of them
/// is settled, rows are sent one at a time, so a refusal names its row.
struct Isolation {
    suspects: HashSet<i64>,
    until: Instant,
}

pub(super) struct Window {
    size: usize,
    confirms: FuturesUnordered<ConfirmFuture>,
    /// Rows sent and not settled yet: handed to lapin (perhaps not written yet, then without a
    /// confirm in `confirms`) or waiting for their confirm.
    in_flight: HashSet<i64>,
    isolation: Option<Isolation>,
    /// Message ids the broker returned (unroutable), with the reason, until their row is settled.
    returned: HashMap<String, String>,
}

impl Window {
    pub fn new(size: usize) -> Self {
        Self {
            size,
            confirms: FuturesUnordered::new(),
            in_flight: HashSet::new(),
            isolation: None,
            returned: HashMap::new(),
        }
    }

    /// Whether a confirm is awaited (guards the loop's wait for [`Self::next`]).
    pub fn awaits_confirms(&self) -> bool {
        !self.confirms.is_empty()
    }

    /// Rows in flight, written or not.
    pub fn len(&self) -> usize {
        self.in_flight.len()
    }

    /// How many more rows may be sent now: one at a time while isolating a refusal.
    pub fn room(&mut self, now: Instant) -> usize {
        if self
            .isolation
            .as_ref()
            .is_some_and(|i| i.suspects.is_empty() || i.until <= now)
        {
            self.isolation = None;
        }
        let size = if self.isolation.is_some() {
            1
        } else {
            self.size
        };
        size.saturating_sub(self.in_flight.len())
    }

    /// Rows handed to lapin: in flight from now on, so a refusal that closes the channel counts
    /// them among the suspects even before lapin has written them.
    pub fn sent(&mut self, seqs: impl IntoIterator<Item = i64>) {
        self.in_flight.extend(seqs);
    }

    /// The confirm of a row [`Self::sent`] before, once lapin has written it.
    pub fn push(&mut self, confirm: ConfirmFuture) {
        self.confirms.push(confirm);
    }

    /// The next confirm (pending forever when none is in flight: guard the select).
    pub async fn next(&mut self) -> Option<(OutboxRow, ConfirmResult, Instant)> {
        self.confirms.next().await
    }

    /// `first` and every other confirm ready now, acks first, with the rows the broker returned
    /// noted. Confirms of one multiple-ack resolve together, and lapin hands a basic.return to
    /// whichever of them it completes first, so returns are matched by message id.
    ///
    /// Acks come first because a failure in the batch drops the link and gives back everything
    /// unconfirmed: rows the broker did confirm need not be published again.
    pub fn ready_batch(
        &mut self,
        first: (OutboxRow, ConfirmResult, Instant),
    ) -> Vec<(OutboxRow, ConfirmResult)> {
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some((row, mut result, sent)) = next {
            internal_events::confirm_duration(sent.elapsed());
            self.note_return(&mut result);
            batch.push((row, result));
            next = self.confirms.next().now_or_never().flatten();
        }
        batch.sort_by_key(|(_, r)| !matches!(r, Ok(Ok(Confirmation::Ack(_)))));
        batch
    }

    fn note_return(&mut self, result: &mut ConfirmResult) {
        if let Ok(Ok(Confirmation::Ack(returned) | Confirmation::Nack(returned))) = result
            && let Some(r) = returned.take()
            && let Some(id) = r.delivery.properties.message_id().as_ref()
        {
            self.returned.insert(
                id.as_str().to_string(),
                format!("unroutable: {} {}", r.reply_code, r.reply_text.as_str()),
            );
        }
    }

    /// Takes `row` out of the window; false if it was not in flight any more (its link was
    /// dropped earlier in the same batch: its answer is that link's, and the row went back).
    pub fn settle(&mut self, row: &OutboxRow) -> bool {
        if !self.in_flight.remove(&row.seq) {
            return false;
        }
        if let Some(isolation) = &mut self.isolation {
            isolation.suspects.remove(&row.seq);
        }
        true
    }

    /// The reason the broker returned `row`'s message, if it did.
    pub fn take_return(&mut self, row: &OutboxRow) -> Option<String> {
        if self.returned.is_empty() {
            return None;
        }
        self.returned.remove(&row.id.to_string())
    }

    /// Every return belongs to a publish that was in flight: none is kept past an empty window.
    pub fn forget_returns_if_idle(&mut self) {
        if self.confirms.is_empty() {
            self.returned.clear();
        }
    }

    /// Whether the row just settled was alone on the wire while isolating: its refusal is its own.
    pub fn was_alone(&self) -> bool {
        self.isolation.is_some() && self.in_flight.is_empty()
    }

    /// The broker closed the channel over one of the rows in flight (and `seq`): send them again
    /// one at a time to find which.
    pub fn isolate(&mut self, seq: i64) -> usize {
        let mut suspects = std::mem::take(&mut self.in_flight);
        suspects.insert(seq);
        let n = suspects.len();
        self.isolation = Some(Isolation {
            suspects,
            until: Instant::now() + ISOLATION_LIMIT,
        });
        n
    }

    /// Drops every confirm (the link is gone); returns how many rows were unconfirmed (after
    /// [`Self::isolate`] took the rows in flight as suspects, their confirms still count them).
    pub fn clear(&mut self) -> usize {
        let n = self.in_flight.len().max(self.confirms.len());
        self.confirms = FuturesUnordered::new();
        self.in_flight.clear();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_nacks_and_timeouts_mean_what_the_relay_does_with_them() {
        let t = Duration::from_secs(5);
        assert_eq!(
            verdict(Ok(Ok(Confirmation::Ack(None))), None, t),
            Verdict::Ack
        );
        assert!(matches!(
            verdict(
                Ok(Ok(Confirmation::Ack(None))),
                Some("unroutable: 312 NO_ROUTE".into()),
                t
            ),
            Verdict::Refused {
                reason: FailureReason::Unroutable,
                ..
            }
        ));
        assert!(matches!(
            verdict(Ok(Ok(Confirmation::Nack(None))), None, t),
            Verdict::Refused {
                reason: FailureReason::Nack,
                ..
            }
        ));
        assert!(matches!(
            verdict(Ok(Ok(Confirmation::NotRequested)), None, t),
            Verdict::LinkFailed {
                reason: FailureReason::Connection,
                ..
            }
        ));
        let lost = lapin::Error::from(lapin::ErrorKind::InvalidConnectionState(
            lapin::ConnectionState::Closed,
        ));
        assert!(matches!(
            verdict(Ok(Err(lost)), None, t),
            Verdict::LinkFailed {
                reason: FailureReason::Connection,
                ..
            }
        ));
    }

    #[tokio::test]
    async fn a_timeout_is_the_links_never_the_rows() {
        let elapsed = tokio::time::timeout(Duration::ZERO, std::future::pending::<()>())
            .await
            .unwrap_err();
        assert!(matches!(
            verdict(Err(elapsed), None, Duration::from_secs(5)),
            Verdict::LinkFailed {
                reason: FailureReason::ConfirmTimeout,
                ..
            }
        ));
    }

    #[test]
    fn rows_handed_to_lapin_are_in_flight_before_their_confirm_exists() {
        let now = Instant::now();
        let mut w = Window::new(3);
        w.sent([1, 2]);
        assert!(!w.awaits_confirms(), "nothing written yet");
        assert_eq!((w.len(), w.room(now)), (2, 1));
        // The broker closes the channel over a row while the batch is still being written: the
        // unwritten rows are suspects too, and none is alone on the wire.
        assert!(!w.was_alone());
        assert_eq!(w.isolate(3), 3);
        assert_eq!(w.room(now), 1);
        assert_eq!(w.clear(), 0);
    }

    #[test]
    fn isolation_sends_one_at_a_time_until_every_suspect_settled() {
        let mut w = Window::new(100);
        let now = Instant::now();
        assert_eq!(w.room(now), 100);
        w.in_flight.extend([1, 2]);
        assert_eq!(w.isolate(3), 3);
        assert!(w.in_flight.is_empty());
        assert_eq!(w.room(now), 1);
        assert!(w.was_alone());
        for seq in [1, 2, 3] {
            w.in_flight.insert(seq);
            w.settle(&row(seq));
        }
        assert_eq!(w.room(now), 100, "every suspect settled");
    }

    fn row(seq: i64) -> OutboxRow {
        OutboxRow {
            seq,
            id: uuid::Uuid::nil(),
            aggregate_type: "t".into(),
            aggregate_id: "a".into(),
            aggregate_seq: seq,
            event_type: "e".into(),
            payload: "{}".into(),
            headers: Default::default(),
            created_at: chrono::Utc::now(),
            attempts: 0,
            partition: 0,
        }
    }
}
