//! Your own consumer in ~20 lines: a handler for `order.placed`, registered and run.
//! The `order_totals` table belongs to your own migration.
//!
//! cargo run -p consumer --example custom_handler

use consumer::{Config, Handler, HandlerError, Handlers};
use shared::Envelope;
use sqlx::PgConnection;
use std::time::Duration;

#[derive(serde::Deserialize)]
struct OrderPlaced {
    order_id: String,
    total_cents: i64,
}

struct OrderTotals;

impl Handler for OrderTotals {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        // A payload that cannot parse never will: permanent, dead-lettered at once.
        let order: OrderPlaced = msg.payload_as().map_err(HandlerError::permanent)?;
        // Runs in the runtime's transaction, which also records the message as processed.
        sqlx::query("INSERT INTO order_totals (order_id, total_cents) VALUES ($1, $2)")
            .bind(&order.order_id)
            .bind(order.total_cents)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    plumbing::telemetry::init_logging();
    let shutdown = plumbing::shutdown::on_signal();
    let mut config = Config::new(
        "order-totals",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        "outbox.events",
    );
    config.metrics_addr = Some("127.0.0.1:9102".parse()?);
    let db = "postgres://postgres@127.0.0.1:5432/test";
    let pool = plumbing::db::connect_and_migrate(
        db,
        config.pool_size(),
        "order-totals",
        &config.schema,
        Duration::from_secs(60),
    )
    .await?;
    let handlers = Handlers::new().on("order.placed", OrderTotals);
    consumer::run(config, pool, handlers, shutdown).await?;
    Ok(())
}
