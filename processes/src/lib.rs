//! Recoverable multi-step processes on PostgreSQL.
//!
//! A short tour:
//! - [`definition`]: a process is Rust code: a kind, a version and ordered steps with stable
//!   names; each step is local (effect and checkpoint in one transaction) or external (with what
//!   its remote supports: an idempotency key, a status query, or neither), with a retry policy
//!   ([`retry`]), an error classification ([`error`]) and an optional, possibly sensitive,
//!   compensation.
//! - [`start`](mod@start): start a process inside the caller's transaction (once per kind and business key);
//!   revise one (changed input is a new linked process).
//! - [`worker`]: claims due processes (with their steps) with `FOR UPDATE SKIP LOCKED` and a
//!   lease whose fencing token grows on every claim; `runner` runs one claimed process step by
//!   step, consecutive local steps in one transaction with one checkpoint statement; every write
//!   goes through the claim's [`store::Lease`] (schema, id, token), fenced by the token.
//! - [`claim_floor`]: where a worker's claim starts reading the due index, so that an old snapshot's
//!   dead entries are not walked again in every claim.
//! - [`fair`]: a worker with a weighted fair share claims the due processes of each fair key (a
//!   tenant) in turn, by weight, so one key's burst cannot starve the others.
//! - `decide`: the decisions over the step rows, pure and unit-tested beside them: the next step,
//!   local groups, what an error leads to, the compensation plan, and the operators' allowed
//!   actions, requirements and doubts (re-exported by [`admin`]).
//! - [`signal`](mod@signal): wakes processes waiting for an event (a [`WaitStep`]), in the
//!   caller's transaction; an event that comes before its wait is kept for it.
//! - [`admin`]: what operators see and may do (list, get with history, the actions allowed now).
//! - [`status`]: [`ProcessStatus`] and [`StepStatus`], the states as types.
//! - [`look`]: what a person looking at processes reads besides the views: compensation labels,
//!   the manual-review backlog, the processes of a business key.
//! - [`redact`]: inputs and messages as stored for display.
//! - [`internal_events`]: the metrics.
//!
//! The worker wakes through `plumbing::listen` (LISTEN on its own one-connection pool) and
//! refreshes its gauges through `plumbing::periodic`; it takes `plumbing` without default
//! features, so embedding a worker pulls neither lapin nor axum nor OpenTelemetry.
//!
//! The state machine lives in the database (migration `0005_processes.sql`): CHECK constraints,
//! a table of allowed transitions enforced by triggers, evidence required by terminal states, and
//! an append-only history of every transition with its reason.
//!
//! **Tables.** `processes`, `process_steps`, `process_history`, `process_transitions` and
//! `process_events`. Other crates read and act on them through [`admin`], start processes through
//! [`start`](mod@start) and wake them through [`signal`](mod@signal).

pub mod admin;
pub mod claim_floor;
mod decide;
pub mod definition;
pub mod error;
pub mod fair;
pub mod find;
pub mod internal_events;
pub mod look;
pub mod money;
pub mod redact;
pub mod retry;
mod runner;
pub mod signal;
pub mod start;
pub mod status;
pub mod store;
pub mod worker;

pub use definition::{
    Action, Definition, Done, ExternalStep, LocalStep, Lookup, Registry, Remote, Role, Step,
    StepContext, StepFuture, TimerStep, WaitStep,
};
pub use error::{Error, ErrorClass, StepError};
pub use fair::FairShare;
pub use retry::RetryPolicy;
pub use signal::{Signalled, signal};
pub use start::{Started, revise, start, start_in};
pub use status::{ProcessStatus, StepStatus};
pub use worker::{DatabaseHook, Worker, WorkerConfig, WorkerError};
