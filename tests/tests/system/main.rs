//! The system tests, one test binary: each module is an area (formerly a test binary of its own,
//! each linking the whole workspace). A test is addressed as `<module>::<name>`, e.g.
//! `cargo nextest run -p system-tests -E 'test(/^relay::/)'`. The shared harnesses (databases,
//! brokers, child processes, waiting for messages) are in `tests/src` (crate `system_tests`).

mod alerts;
mod bench_smoke;
mod broker_alarm;
mod cloudevents;
mod cluster;
mod console;
mod consumer;
mod consumer_fair_share;
mod db_crash;
mod dependencies;
mod drop_in;
mod fair_share;
mod fault_campaign;
mod hostile_deliveries;
mod hostile_rows;
mod idempotency_layer;
mod late_commit;
mod ordered_consumer;
mod ordered_faults;
mod ordering;
mod outage;
mod payment_async;
mod payment_flow;
mod payment_provider;
mod pgbouncer;
mod plans;
mod process_groups;
mod process_waits;
mod processes;
mod producer;
mod purges;
mod reconciliation;
mod relay;
mod timeline;
mod tls;
mod trace;
mod verify;
mod webhooks;
