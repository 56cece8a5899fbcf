//! What the supervisor and its workers share: the consumer's configuration, pool, handlers,
//! topology, counters and readiness ([`Ctx`]), and the bound on every broker round trip
//! ([`bounded`]).

use crate::config::Config;
use crate::error::SessionError;
use crate::handler::Handlers;
use crate::internal_events::Stats;
use crate::topology::Topology;
use plumbing::telemetry::Readiness;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;

/// Bound on every broker round trip the runtime waits for (declare, confirm, ack, close).
pub(crate) const BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// One consumer's settings and shared state, built once by [`crate::Consumer::new`].
pub(crate) struct Ctx {
    pub(crate) config: Config,
    pub(crate) pool: PgPool,
    /// The dependencies' bookkeeping (circuit reads and writes, slots, tokens): a pool of its
    /// own, two connections made when first used, so a worker asking a circuit from inside its
    /// batch transaction never waits for a connection another worker's transaction holds.
    pub(crate) breaker_pool: PgPool,
    pub(crate) handlers: Handlers,
    pub(crate) topology: Topology,
    pub(crate) bindings: Vec<String>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) readiness: Arc<Readiness>,
    /// The fair share, if the consumer has one (its lanes are in the topology).
    pub(crate) fairness: Option<crate::fair::FairShare>,
}

/// `fut`, failing with [`SessionError::Timeout`] after [`BROKER_TIMEOUT`]: a broker that stops
/// answering ends the session (and the reconnect starts) instead of hanging a worker.
pub(crate) async fn bounded<T, E>(
    what: &'static str,
    fut: impl Future<Output = Result<T, E>>,
    wrap: impl FnOnce(E) -> SessionError,
) -> Result<T, SessionError> {
    match tokio::time::timeout(BROKER_TIMEOUT, fut).await {
        Ok(r) => r.map_err(wrap),
        Err(_) => Err(SessionError::Timeout(what, BROKER_TIMEOUT)),
    }
}
