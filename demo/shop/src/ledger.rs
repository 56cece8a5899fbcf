//! The example application's consumer handler: `payment.captured` events move ledger balances
//! (`demo.ledger_balances`), run by `producer ledger`.
//!
//! `balance = balance + amount, updates = updates + 1` is deliberately not idempotent: applied
//! twice, the balance is wrong. The runtime's deduplication is what keeps it right.

use consumer::{Handler, HandlerError, Handlers};
use serde::Deserialize;
use shared::Envelope;
use sqlx::PgConnection;
use std::collections::BTreeMap;

/// The event type the ledger handles.
pub const EVENT_TYPE: &str = "payment.captured";

/// Payload of a `payment.captured` event.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct PaymentCaptured {
    pub account: String,
    pub amount: i64,
}

/// Adds captured payments to `ledger_balances`.
#[derive(Debug, Clone, Copy)]
pub struct Ledger {
    /// Named prepared statements (the default); unnamed behind a transaction pooler that does
    /// not keep them (the consumer's `named_statements`).
    pub named_statements: bool,
}

impl Default for Ledger {
    fn default() -> Self {
        Self {
            named_statements: true,
        }
    }
}

impl Handler for Ledger {
    async fn handle(&self, tx: &mut PgConnection, msg: &Envelope) -> Result<(), HandlerError> {
        // A payload that does not parse never will: dead-letter it at once.
        let p: PaymentCaptured = msg.payload_as().map_err(HandlerError::permanent)?;
        sqlx::query(
            "INSERT INTO demo.ledger_balances (account, balance, updates) VALUES ($1, $2, 1) \
             ON CONFLICT (account) DO UPDATE \
             SET balance = demo.ledger_balances.balance + EXCLUDED.balance, updates = demo.ledger_balances.updates + 1",
        )
        .bind(&p.account)
        .bind(p.amount)
        .persistent(self.named_statements)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    /// The same effect for a whole batch in one statement: amounts summed per account, accounts
    /// in sorted order (concurrent batches lock rows in the same order, so they cannot deadlock).
    /// Any error makes the runtime fall back to [`Ledger::handle`] per message.
    async fn handle_batch(
        &self,
        tx: &mut PgConnection,
        msgs: &[&Envelope],
    ) -> Result<(), HandlerError> {
        let mut sums: BTreeMap<String, (i64, i64)> = BTreeMap::new();
        for msg in msgs {
            let p: PaymentCaptured = msg.payload_as().map_err(HandlerError::permanent)?;
            let (balance, updates) = sums.entry(p.account).or_default();
            *balance = balance
                .checked_add(p.amount)
                .ok_or_else(|| HandlerError::transient("batch sum overflows"))?;
            *updates += 1;
        }
        let mut accounts = Vec::with_capacity(sums.len());
        let mut amounts = Vec::with_capacity(sums.len());
        let mut counts = Vec::with_capacity(sums.len());
        for (account, (amount, count)) in sums {
            accounts.push(account);
            amounts.push(amount);
            counts.push(count);
        }
        sqlx::query(
            "INSERT INTO demo.ledger_balances (account, balance, updates) \
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[]) \
             ON CONFLICT (account) DO UPDATE \
             SET balance = demo.ledger_balances.balance + EXCLUDED.balance, \
                 updates = demo.ledger_balances.updates + EXCLUDED.updates",
        )
        .bind(&accounts)
        .bind(&amounts)
        .bind(&counts)
        .persistent(self.named_statements)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// The handlers of `producer ledger`: the ledger for `payment.captured`.
pub fn handlers() -> Handlers {
    handlers_with(true)
}

/// [`handlers`] with named or unnamed statements (see [`consumer::Config::named_statements`]).
pub fn handlers_with(named_statements: bool) -> Handlers {
    Handlers::new().on(EVENT_TYPE, Ledger { named_statements })
}
