//! Serving TCP connections with hyper directly, so that a handler can really drop its connection:
//! [`AbortConnection::reset`] makes the connection's task close the socket with `SO_LINGER` 0,
//! which sends a TCP RST instead of an answer (the `reset_after_charge` fault).

use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long open connections may finish their requests after shutdown began.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Handed to every request of one connection (as an axum `Extension`): resets that connection.
#[derive(Debug, Clone, Default)]
pub struct AbortConnection(CancellationToken);

impl AbortConnection {
    /// Drops the connection without an answer (TCP RST), whatever the handler does next.
    pub fn reset(&self) {
        self.0.cancel();
    }
}

/// Accepts connections until `shutdown`, then lets open ones finish for a few seconds.
pub async fn serve(listener: TcpListener, app: Router, shutdown: CancellationToken) {
    let tracker = TaskTracker::new();
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: pause instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        tracker.spawn(connection(stream, app.clone(), shutdown.clone()));
    }
    tracker.close();
    if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the shutdown grace period: dropped");
    }
}

async fn connection(stream: TcpStream, app: Router, shutdown: CancellationToken) {
    // A second descriptor of the socket: hyper owns the stream, this one sets SO_LINGER on reset.
    let (stream, twin) = match split(stream) {
        Ok(pair) => pair,
        Err(e) => {
            tracing::warn!(error = %e, "cannot set up a connection");
            return;
        }
    };
    let abort = AbortConnection::default();
    let service = TowerToHyperService::new(app.layer(axum::Extension(abort.clone())));
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = abort.0.cancelled() => {
                if let Err(e) = socket2::SockRef::from(&twin).set_linger(Some(Duration::ZERO)) {
                    tracing::warn!(error = %e, "cannot set SO_LINGER: the connection closes without a reset");
                }
                // Dropping the connection (and the twin) closes the socket: RST, no answer.
                return;
            }
            _ = shutdown.cancelled(), if !draining => {
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
        }
    }
}

fn split(stream: TcpStream) -> std::io::Result<(TcpStream, std::net::TcpStream)> {
    let std = stream.into_std()?;
    let twin = std.try_clone()?;
    Ok((TcpStream::from_std(std)?, twin))
}
