//! Named remote dependencies with a circuit breaker, a concurrency cap and a rate limit that
//! every worker and instance shares through PostgreSQL, so a remote that is down is waited out in
//! one place: nobody floods it, nobody spends attempts on it, and a restart forgets nothing.
//!
//! A short tour:
//! - [`policy`]: [`Policy`]: when a circuit opens (unavailable answers in a row, or a failure
//!   rate over a window), its cool-downs, the resume rate, the optional cap and rate limit.
//! - [`state`]: [`CircuitState`], the states as a type.
//! - [`circuit`]: the decisions, pure and unit-tested: [`circuit::admit`] (may a call go now)
//!   and [`circuit::record`] (what an answer changes), as a transition table.
//! - [`dependency`]: [`Dependency`]: `acquire` gives a [`Permit`] or a [`Wait`]; the permit
//!   records the call's [`Outcome`]. The process worker and the consumer runtime call it around
//!   each remote call of a step or handler that names the dependency.
//! - `store`: the statements (compare-and-set on the circuit's version, the token bucket and the
//!   slots each in one statement).
//! - [`admin`]: what operators see and do (list, open or close a circuit by hand, audited).
//! - [`internal_events`]: the metrics.
//!
//! Only "unavailable" answers count: refused before anything was done (503, 429, connection
//! refused, a timeout before the request was sent). An unknown outcome (no answer after the
//! request was sent) is never counted as unavailability.
//!
//! **Tables** (migration `0021_dependencies.sql`): `dependencies` (one row per dependency: its
//! circuit and its bucket), `dependency_slots` (the concurrency cap) and `dependency_history`
//! (append-only: every transition and operator action).

pub mod admin;
pub mod circuit;
pub mod dependency;
pub mod error;
pub mod internal_events;
pub mod policy;
pub mod state;
mod store;

pub use circuit::{Outcome, WaitReason};
pub use dependency::{Admission, Dependency, Permit, Usage, Wait, valid_name};
pub use error::{AdminError, DeclareError, PolicyError};
pub use policy::Policy;
pub use state::CircuitState;
