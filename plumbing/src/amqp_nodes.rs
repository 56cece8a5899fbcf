//! A RabbitMQ cluster as a list of node URLs: `AMQP_URL` may name several nodes, separated by
//! commas (`amqp://u:p@node1:5672/%2f,amqp://u:p@node2:5672/%2f`). [`connect`] tries them in
//! turn, starting after the node used last, so a connection lost with its node fails over to the
//! next one; the caller's reconnect loop provides the backoff between rounds.
//!
//! Every entry is a full URL (its own credentials, vhost and query). What a connection resumes
//! from is the caller's business: the relay gives back every unconfirmed row when a link fails
//! and publishes it again on the new connection; the consumer's unacknowledged deliveries are
//! redelivered by the broker (and deduplicated).

use crate::amqp::{AmqpError, connect as connect_node};
use lapin::Connection;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where the next connection attempt starts (an index into the list, taken modulo its length).
/// Process-wide: connections of one process spread over the nodes, and a reconnect starts with
/// the node after the one just lost.
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The node URLs of a comma-separated list, trimmed, empty entries skipped.
pub fn parse(list: &str) -> Vec<&str> {
    list.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// The order in which the nodes are tried when the rotation stands at `next`.
pub fn rotation(nodes: usize, next: usize) -> impl Iterator<Item = usize> {
    let start = if nodes == 0 { 0 } else { next % nodes };
    (0..nodes).map(move |i| (start + i) % nodes)
}

/// A URL without its password, for logs: `amqp://guest@host:5672/%2f`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<invalid url>".to_string();
    };
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let host = match authority.rsplit_once('@') {
        Some((user, host)) => {
            let user = user.split_once(':').map_or(user, |(u, _)| u);
            format!("{user}@{host}")
        }
        None => authority.to_string(),
    };
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    format!("{scheme}://{host}/{path}")
}

/// Connects to the first reachable node of `list` (see the module docs), each node once per call.
/// The error is the last node's when none answers.
pub async fn connect(
    list: &str,
    tls: &crate::amqp_tls::AmqpTls,
    name: &str,
) -> Result<Connection, AmqpError> {
    let nodes = parse(list);
    if nodes.len() == 1 {
        return connect_node(nodes[0], tls, name).await;
    }
    let mut last = AmqpError::NoNodes;
    for i in rotation(nodes.len(), NEXT.load(Ordering::Relaxed)) {
        match connect_node(nodes[i], tls, name).await {
            Ok(conn) => {
                NEXT.store(i + 1, Ordering::Relaxed);
                tracing::info!(node = %redact(nodes[i]), connection = name, "connected to RabbitMQ node");
                return Ok(conn);
            }
            Err(e) => {
                tracing::warn!(node = %redact(nodes[i]), connection = name, error = %crate::telemetry::ErrorChain(&e), "RabbitMQ node unreachable; trying the next");
                last = e;
            }
        }
    }
    if !nodes.is_empty() {
        NEXT.fetch_add(1, Ordering::Relaxed);
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_split_on_commas() {
        assert_eq!(parse("amqp://a/%2f"), vec!["amqp://a/%2f"]);
        assert_eq!(
            parse(" amqp://a:1/%2f , amqp://b:2/%2f,,"),
            vec!["amqp://a:1/%2f", "amqp://b:2/%2f"]
        );
        assert!(parse(" , ").is_empty());
    }

    #[test]
    fn rotation_starts_after_the_last_node() {
        assert_eq!(rotation(3, 0).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(rotation(3, 2).collect::<Vec<_>>(), vec![2, 0, 1]);
        assert_eq!(rotation(3, 4).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert_eq!(rotation(0, 4).count(), 0);
    }

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(
            redact("amqp://guest:secret@h:5672/%2f?heartbeat=5"),
            "amqp://guest@h:5672/%2f"
        );
        assert_eq!(redact("amqp://h:5672"), "amqp://h:5672/");
        assert_eq!(redact("nonsense"), "<invalid url>");
    }
}
