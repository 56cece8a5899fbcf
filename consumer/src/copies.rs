//! Retry copies and dead letters: what a copy of a delivery is (where it goes, the headers that
//! say why, see [`crate::message::headers`]) and how it is made to fit one frame. The worker
//! publishes them with publisher confirms before it acknowledges the batch.

use crate::batch::{Fate, Item};
use crate::broker_headers;
use crate::context::Ctx;
use crate::message::{self, headers};
use crate::screen::{self, MAX_HEADER_DEPTH};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use plumbing::amqp::HEADER_FRAME_OVERHEAD;

/// The headers the consumer sets on its copies: [`fit`] never removes them, so a copy keeps why.
pub const OWN_HEADERS: [&str; 9] = [
    headers::ATTEMPT,
    headers::LAST_ERROR,
    headers::ORIGINAL_ROUTING_KEY,
    headers::DEAD_LETTER_REASON,
    headers::DEAD_LETTER_KIND,
    headers::DEAD_LETTERED_AT,
    headers::DEAD_LETTER_CONSUMER,
    headers::REPLAYED_AT,
    headers::REPLAYED_KIND,
];

/// A copy that does not fit one frame even without any of the original's headers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "its copy's properties take {bytes} bytes even without the original headers, more than one frame holds ({limit} bytes)"
)]
pub struct DoesNotFit {
    pub bytes: usize,
    pub limit: usize,
}

/// The exact size of `properties` on the wire (`usize::MAX` if it could not serialize, so that it
/// never fits).
fn properties_len(properties: &BasicProperties) -> usize {
    plumbing::amqp::properties_len(properties).unwrap_or(usize::MAX)
}

/// Makes a copy's properties publishable on a connection with `frame_max`:
/// 1. an original header whose value nests deeper than [`MAX_HEADER_DEPTH`] or could not be
///    parsed is replaced by a note saying so;
/// 2. while the properties do not fit one frame, the largest original header (never one of
///    [`OWN_HEADERS`]) is replaced by a note of its size.
///
/// A note is a string `"(removed from this copy: ...)"`. Errs only when even notes for every
/// original header leave the copy too large (then nothing can be published for it).
pub fn fit(properties: BasicProperties, frame_max: u32) -> Result<BasicProperties, DoesNotFit> {
    let limit = (frame_max as usize).saturating_sub(HEADER_FRAME_OVERHEAD);
    let original = properties.headers().clone().unwrap_or_default();
    let mut table = FieldTable::default();
    // (value bytes with its type byte, name) of every header that may be replaced.
    let mut sizes: Vec<(usize, String)> = Vec::new();
    for (name, value) in original.inner() {
        let mut one = FieldTable::default();
        one.insert(name.clone(), value.clone());
        let shape = screen::measure(&one);
        let value = if shape.unparsed {
            note("could not be parsed")
        } else if shape.depth > MAX_HEADER_DEPTH {
            note(&format!("nested deeper than {MAX_HEADER_DEPTH} levels"))
        } else {
            value.clone()
        };
        if !OWN_HEADERS.contains(&name.as_str()) {
            sizes.push((shape.bytes - 4 - 1 - name.as_str().len(), name.to_string()));
        }
        table.insert(name.clone(), value);
    }
    let mut props = properties.clone().with_headers(table.clone());
    let mut len = properties_len(&props);
    if len <= limit {
        return Ok(props);
    }
    sizes.sort_unstable_by_key(|s| std::cmp::Reverse(s.0));
    for (bytes, name) in &sizes {
        if len <= limit {
            break;
        }
        let replacement = note(&format!("{bytes} bytes"));
        let new_bytes = 1 + 4 + note_len(&replacement);
        table.insert(name.as_str().into(), replacement);
        len = len.saturating_sub(*bytes) + new_bytes;
    }
    props = properties.with_headers(table);
    let len = properties_len(&props);
    if len <= limit {
        Ok(props)
    } else {
        Err(DoesNotFit { bytes: len, limit })
    }
}

fn note(what: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(format!(
        "(removed from this copy: {what})"
    )))
}

fn note_len(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::LongString(s) => s.as_bytes().len(),
        _ => 0,
    }
}

/// A retry copy or a dead letter of one delivery, ready to publish.
pub(crate) struct Copy {
    pub exchange: String,
    pub routing_key: String,
    pub properties: BasicProperties,
    /// For errors: `retry of <message id>` or `dead letter of <message id>`.
    pub what: String,
}

/// A copy into retry queue `queue` (the main queue if there is none): its attempt number and last
/// error set; the routing key to publish it with on the default exchange.
fn delayed(
    ctx: &Ctx,
    table: &mut FieldTable,
    queue: Option<&str>,
    attempt: i64,
    reason: &str,
) -> String {
    message::set_int(table, headers::ATTEMPT, attempt);
    message::set_text(table, headers::LAST_ERROR, &message::truncate(reason, 1000));
    queue.unwrap_or(&ctx.topology.queue).to_string()
}

/// The copy `fate` asks for of `item`'s delivery: `Ok(None)` when the fate needs none (processed,
/// duplicate, ignored); `Err` when it cannot be made to fit one frame of `frame_max` (see [`fit`]).
pub(crate) fn copy_of(
    ctx: &Ctx,
    item: &Item,
    fate: &Fate,
    frame_max: u32,
) -> Result<Option<Copy>, DoesNotFit> {
    let d = &item.delivery;
    let original_key = message::original_routing_key(&d.properties, d.routing_key.as_str());
    let mut table = d.properties.headers().clone().unwrap_or_default();
    // A copy is a new message to the broker: its `x-death` could make RabbitMQ 3.x drop it.
    broker_headers::strip(&mut table);
    message::set_text(&mut table, headers::ORIGINAL_ROUTING_KEY, &original_key);
    let (exchange, routing_key, kind) = match fate {
        Fate::Retry(reason) => {
            let queue = ctx
                .topology
                .retry_queue(ctx.config.retry_delay(item.attempt));
            let attempt = i64::from(item.attempt) + 1;
            (
                String::new(),
                delayed(ctx, &mut table, queue, attempt, reason),
                "retry",
            )
        }
        // Waiting for a remote spends no attempt: the copy keeps the delivery's attempt number.
        Fate::Wait(reason, wait) => {
            let queue = ctx.topology.retry_queue_at_least(*wait);
            let attempt = i64::from(item.attempt);
            (
                String::new(),
                delayed(ctx, &mut table, queue, attempt, reason),
                "wait",
            )
        }
        // Sorted into a fair share's lane: the same message, its attempt kept.
        Fate::Lane(queue) => {
            message::set_int(&mut table, headers::ATTEMPT, i64::from(item.attempt));
            (String::new(), queue.clone(), "lane")
        }
        Fate::DeadLetter(kind, reason) => {
            message::set_int(&mut table, headers::ATTEMPT, i64::from(item.attempt));
            message::set_text(&mut table, headers::DEAD_LETTER_KIND, kind.as_str());
            message::set_text(
                &mut table,
                headers::DEAD_LETTER_REASON,
                &message::truncate(reason, 2000),
            );
            message::set_text(
                &mut table,
                headers::DEAD_LETTERED_AT,
                &chrono::Utc::now().to_rfc3339(),
            );
            message::set_text(&mut table, headers::DEAD_LETTER_CONSUMER, &ctx.config.name);
            (
                ctx.topology.dead_letter_exchange.clone(),
                original_key,
                "dead letter",
            )
        }
        Fate::Processed
        | Fate::Duplicate
        | Fate::Ignored
        | Fate::Discarded
        | Fate::Held
        | Fate::Stale => return Ok(None),
    };
    let properties = fit(
        d.properties
            .clone()
            .with_headers(table)
            .with_delivery_mode(2),
        frame_max,
    )?;
    let what = format!(
        "{kind} of {}",
        d.properties
            .message_id()
            .as_ref()
            .map_or("(no message id)", |s| s.as_str())
    );
    Ok(Some(Copy {
        exchange,
        routing_key,
        properties,
        what,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header_strategies::{cases, nested};
    use lapin::types::{FieldArray, ShortString};
    use proptest::prelude::*;

    fn props(headers: FieldTable) -> BasicProperties {
        BasicProperties::default()
            .with_message_id("0192d3a4-0000-7000-8000-000000000001".into())
            .with_type("payment.captured".into())
            .with_headers(headers)
    }

    fn text(p: &BasicProperties, name: &str) -> String {
        p.headers()
            .as_ref()
            .and_then(|t| plumbing::amqp::header_str(t, name))
            .unwrap_or_default()
            .into_owned()
    }

    #[test]
    fn a_copy_that_fits_is_unchanged() {
        let mut t = FieldTable::default();
        message::set_text(&mut t, "traceparent", "00-a-b-01");
        let p = props(t);
        assert_eq!(fit(p.clone(), 131_072).unwrap(), p);
    }

    #[test]
    fn the_largest_original_headers_go_first_and_the_reason_stays() {
        let mut t = FieldTable::default();
        message::set_text(&mut t, "big", &"x".repeat(100_000));
        message::set_text(&mut t, "small", "kept");
        message::set_text(&mut t, headers::DEAD_LETTER_REASON, &"r".repeat(2000));
        let fitted = fit(props(t), 131_072 / 2).unwrap();
        assert!(properties_len(&fitted) + HEADER_FRAME_OVERHEAD <= 131_072 / 2);
        assert_eq!(
            text(&fitted, "big"),
            "(removed from this copy: 100005 bytes)"
        );
        assert_eq!(text(&fitted, "small"), "kept");
        assert_eq!(text(&fitted, headers::DEAD_LETTER_REASON), "r".repeat(2000));
    }

    #[test]
    fn values_nested_too_deep_are_replaced_even_when_they_fit() {
        let mut v = AMQPValue::Boolean(true);
        for _ in 0..MAX_HEADER_DEPTH {
            v = AMQPValue::FieldArray(FieldArray::from(vec![v]));
        }
        let mut t = FieldTable::default();
        t.insert("deep".into(), v);
        let fitted = fit(props(t), 131_072).unwrap();
        assert!(text(&fitted, "deep").contains("nested deeper than"));
    }

    #[test]
    fn a_copy_too_large_even_without_headers_does_not_fit() {
        let long = ShortString::from("x".repeat(255));
        let mut t = FieldTable::default();
        message::set_text(&mut t, headers::DEAD_LETTER_REASON, &"r".repeat(4000));
        let p = props(t)
            .with_content_type(long.clone())
            .with_correlation_id(long.clone())
            .with_reply_to(long);
        let err = fit(p, 4096).unwrap_err();
        assert!(err.bytes > err.limit);
    }

    fn value() -> impl Strategy<Value = AMQPValue> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            prop::collection::vec(any::<u8>(), 0..20_000)
                .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
        ];
        nested(leaf, "[a-z]{1,8}", 64, 4)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        /// Whatever headers a delivery has, its copy either fits the frame with the consumer's
        /// own headers intact and no value nested too deep, or is refused: never a panic, never
        /// a copy the broker would refuse for its size.
        #[test]
        fn any_copy_fits_or_is_refused(
            headers in prop::collection::btree_map("[a-z\u{fffd}]{1,40}", value(), 0..12),
            reason in ".{0,2000}",
            frame_max in 4096u32..200_000,
        ) {
            let mut t = FieldTable::default();
            for (k, v) in headers {
                t.insert(k.as_str().into(), v);
            }
            message::set_text(&mut t, headers::DEAD_LETTER_REASON, &reason);
            if let Ok(p) = fit(props(t), frame_max) {
                prop_assert!(properties_len(&p) + HEADER_FRAME_OVERHEAD <= frame_max as usize);
                prop_assert_eq!(text(&p, headers::DEAD_LETTER_REASON), reason);
                let table = p.headers().clone().unwrap_or_default();
                prop_assert!(screen::measure(&table).depth <= MAX_HEADER_DEPTH);
            }
        }
    }
}
