//! Errors as one log field: shared's [`ErrorChain`], which the idempotency layer (it depends on
//! shared, not on plumbing) logs with too.

pub use shared::error_chain::ErrorChain;
