//! Stop taking work while nothing could be done with it: when every handler of the consumer
//! names a dependency ([`crate::Handlers::on_needing`]) and each of those dependencies' circuits
//! holds calls back, a worker takes no new deliveries until the earliest probe is due. The
//! backlog stays in RabbitMQ, where it belongs, instead of cycling through the retry queues; the
//! worker cancels its consumer and settles what the broker had already sent. When the first
//! dependency's probe is due, it consumes again with a prefetch of one (a probing consumer: one
//! message finds out whether the remote is back, not a prefetch's worth cycling through the retry
//! queues) and, once the circuit lets calls go, with its full prefetch. When some handler
//! needs no dependency, or another one that is up, the worker goes on taking deliveries and only
//! the messages for the held dependency wait (in a retry queue, or in place in ordered mode).

use crate::context::Ctx;
use chrono::Utc;
use std::time::Duration;

/// The longest pause between two looks at the circuits: a probe elsewhere may close one early.
const LOOK_AGAIN: Duration = Duration::from_secs(1);

/// Whether every dependency of the handlers was, when this instance last saw it, letting calls
/// go (after a probing consumer's batch: consume at the full prefetch again).
pub(crate) fn all_let_through(ctx: &Ctx) -> bool {
    ctx.handlers.all_dependencies().is_none_or(|deps| {
        deps.iter()
            .all(|d| d.last_seen().is_none_or(|c| c.lets_through()))
    })
}

/// How long the worker should take no deliveries, if every handler's dependency holds calls back
/// now; `None` while some handler could run. Reads the circuits only when this instance last saw
/// each of them not letting calls go (the happy path asks nothing).
pub(crate) async fn held_for(ctx: &Ctx) -> Option<(Duration, String)> {
    let deps = ctx.handlers.all_dependencies()?;
    if deps
        .iter()
        .any(|d| d.last_seen().is_none_or(|c| c.lets_through()))
    {
        return None;
    }
    let mut pause = LOOK_AGAIN;
    let mut names = Vec::with_capacity(deps.len());
    for dep in deps {
        // Fresh: another instance may have probed and closed it.
        let c = dep
            .circuit(&ctx.breaker_pool, &ctx.config.schema)
            .await
            .ok()?;
        let now = Utc::now();
        let lease = ctx.config.handler_timeout + Duration::from_secs(5);
        match breaker::circuit::admit(&c, now, lease).0 {
            breaker::circuit::Admit::Go { .. } => return None,
            breaker::circuit::Admit::Wait { until, .. } => {
                let left = (until - now).to_std().unwrap_or_default();
                pause = pause.min(left);
            }
        }
        names.push(dep.name().to_string());
    }
    Some((pause.max(Duration::from_millis(50)), names.join(", ")))
}
