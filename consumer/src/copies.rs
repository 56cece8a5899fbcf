//! Retry copies and dead letters: published with publisher confirms before the batch is
//! acknowledged, each carrying the headers that say why (see [`crate::message::headers`]).

use crate::batch::Fate;
use crate::error::SessionError;
use crate::message::{self, headers};
use crate::supervisor::BROKER_TIMEOUT;
use crate::worker::{Item, Worker};
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, PublisherConfirm};

impl Worker {
    /// Publishes the retry copies and dead letters of this batch and waits for the broker's
    /// confirms, so that the multi-ack that follows loses nothing.
    /// confirms, so that the multi-ack that follows loses nothing.
    pub(crate) async fn publish_copies(
        &self,
        items: &[Item],
        fates: &[Option<Fate>],
    ) -> Result<(), SessionError> {
        let mut pending: Vec<(PublisherConfirm, String)> = Vec::new();
        for (item, fate) in items.iter().zip(fates) {
            let d = &item.delivery;
            let original_key = message::original_routing_key(&d.properties, d.routing_key.as_str());
            let mut table = d.properties.headers().clone().unwrap_or_default();
            message::set_text(&mut table, headers::ORIGINAL_ROUTING_KEY, &original_key);
            let (exchange, routing_key) = match fate {
                Some(Fate::Retry(reason)) => {
                    let delay = self.ctx.config.retry_delay(item.attempt);
                    let queue = self
                        .ctx
                        .topology
                        .retry_queue(delay)
                        .unwrap_or(&self.ctx.topology.queue);
                    message::set_int(&mut table, headers::ATTEMPT, i64::from(item.attempt) + 1);
                    message::set_text(
                        &mut table,
                        headers::LAST_ERROR,
                        &message::truncate(reason, 1000),
                    );
                    (String::new(), queue.to_string())
                }
                Some(Fate::DeadLetter(kind, reason)) => {
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
                    message::set_text(
                        &mut table,
                        headers::DEAD_LETTER_CONSUMER,
                        &self.ctx.config.name,
                    );
                    (self.ctx.topology.dead_letter_exchange.clone(), original_key)
                }
                _ => continue,
            };
            let props: BasicProperties = d
                .properties
                .clone()
                .with_headers(table)
                .with_delivery_mode(2);
            let confirm = self
                .publish_ch
                .basic_publish(
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &d.data,
                    props,
                )
                .await
                .map_err(SessionError::Publish)?;
            let what = format!(
                "{} of {}",
                if exchange.is_empty() {
                    "retry"
                } else {
                    "dead letter"
                },
                d.properties
                    .message_id()
                    .as_ref()
                    .map_or("(no message id)", |s| s.as_str())
            );
            pending.push((confirm, what));
        }
        let deadline = tokio::time::Instant::now() + BROKER_TIMEOUT;
        for (confirm, what) in pending {
            let confirmation = tokio::time::timeout_at(deadline, confirm)
                .await
                .map_err(|_| SessionError::Timeout("publisher confirm", BROKER_TIMEOUT))?
                .map_err(SessionError::Publish)?;
            if !confirmation.is_ack() {
                return Err(SessionError::NotConfirmed(format!("{what}: nacked")));
            }
            if let Some(returned) = confirmation.take_message() {
                return Err(SessionError::NotConfirmed(format!(
                    "{what}: returned ({})",
                    returned.reply_text
                )));
            }
        }
        Ok(())
    }
}
