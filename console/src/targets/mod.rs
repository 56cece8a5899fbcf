//! What the console acts on, each through the crate that owns it: dead outbox rows (the relay
//! crate's `messages`), consumer dead letters (RabbitMQ, through `consumer::dlq`), processes
//! (`processes::admin`) and ordered consumers (`consumer::ordered::admin`). Each target says
//! what an effect changed as a [`Change`], which the actions layer writes to the audit log.
//! [`samples`] keeps the overview's figures over time (the console's own table).

pub mod change;
pub mod cursor;
pub mod dead_letters;
pub mod dead_letters_page;
pub mod dependencies;
pub mod ordered;
pub mod outbox_dead;
pub mod outbox_dead_page;
pub mod processes;
pub mod samples;

pub use change::Change;
