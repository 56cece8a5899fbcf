//! The consumer's two connections to RabbitMQ: one consumes and acknowledges, the other
//! publishes the copies (retries, dead letters).
//!
//! RabbitMQ blocks a connection that publishes during a resource alarm (memory, disk) and then
//! reads nothing more from it, acknowledgements included. Were the copies published on the
//! consuming connection, one retry during an alarm would stop every worker's acks, so the queues
//! whose depth raised the alarm could not drain. On a connection of their own, only the workers
//! with a copy to publish wait; the others go on consuming and acknowledging.

use lapin::Connection;
use plumbing::amqp::AmqpError;
use plumbing::amqp_tls::AmqpTls;
use std::time::Duration;

pub(crate) struct Links {
    /// Consumes and acknowledges; publishes nothing, so no alarm blocks it.
    pub consume: Connection,
    /// Publishes the copies, with confirms.
    pub publish: Connection,
}

impl Links {
    /// Opens both, named `<name>` and `<name> (copies)` in the management UI.
    pub async fn open(url: &str, tls: &AmqpTls, name: &str) -> Result<Self, AmqpError> {
        let consume = plumbing::amqp_nodes::connect(url, tls, name).await?;
        match plumbing::amqp_nodes::connect(url, tls, &format!("{name} (copies)")).await {
            Ok(publish) => Ok(Self { consume, publish }),
            Err(e) => {
                close(&consume).await;
                Err(e)
            }
        }
    }

    /// Both still open.
    pub fn connected(&self) -> bool {
        self.consume.status().connected() && self.publish.status().connected()
    }

    /// Closes both, waiting at most 5 s for each.
    pub async fn close(&self) {
        close(&self.consume).await;
        close(&self.publish).await;
    }
}

async fn close(conn: &Connection) {
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        conn.close(200, "consumer stopping".into()),
    )
    .await;
}
