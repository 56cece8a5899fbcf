//! The `console` binary's subcommands other than `serve` and `migrate`: their flags ([`args`]),
//! the typed API client they call ([`client`] for the transport, [`api`] for the calls), how the
//! answers print ([`mod@print`]), and the user commands that go to the database ([`users`]).

pub mod api;
pub mod args;
pub mod client;
pub mod print;
pub mod users;

pub use client::{Client, ClientError};
