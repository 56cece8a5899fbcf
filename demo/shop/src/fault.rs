//! Fault injection for tests: a hook called at every [`Stage`] of every idempotent POST. It may
//! return an error, panic, or wait (to hold a request in `processing`).

use futures::future::BoxFuture;
use std::sync::Arc;
use uuid::Uuid;

/// The demo's idempotent operations; each is one [`idempotency::IdempotencyLayer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    CreateOrder,
    CreatePayment,
}

impl Operation {
    /// The operation name the records are keyed by (and the metrics' `operation` label).
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::CreateOrder => "create_order",
            Operation::CreatePayment => "create_payment",
        }
    }

    /// The URL of a resource this operation created.
    pub fn location(self, id: Uuid) -> String {
        match self {
            Operation::CreateOrder => format!("/orders/{id}"),
            Operation::CreatePayment => format!("/payments/{id}"),
        }
    }
}

/// Points of a POST where the fault hook is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The key is reserved (record `processing`), the effect transaction has not started.
    Reserved,
    /// The handler wrote its business rows and outbox event into the effect transaction and is
    /// about to return; the layer then completes the record in it and commits.
    BeforeCommit,
}

/// A failure injected by the fault hook; handled like a database error at that point.
#[derive(Debug, Clone, thiserror::Error)]
#[error("injected fault: {0}")]
pub struct InjectedFault(pub String);

/// The hook: called with the stage and the operation.
pub type FaultHook =
    Arc<dyn Fn(Stage, Operation) -> BoxFuture<'static, Result<(), InjectedFault>> + Send + Sync>;
