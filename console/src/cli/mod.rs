//! The `console` binary's subcommands: a typed client of the API and how its answers print.

pub mod client;
