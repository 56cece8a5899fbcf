//! Errors as one log field: shared's [`ErrorChain`], which the idempotency layer (below plumbing)
//! logs with too.

pub use shared::error_chain::ErrorChain;
