//! Who is asking: users and their roles, web sessions, and the Idempotency-Keys scoped to a user.
//! Depends on nothing of the console but [`crate::error`] and [`crate::text`].

pub mod keys;
pub mod roles;
pub mod sessions;
pub mod users;
