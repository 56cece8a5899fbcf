-- Consumer-side bookkeeping: per-consumer deduplication, and the example ledger handler's table.
--
-- A consumer applies an event's effect and records (consumer, message_id) here in the same
-- transaction, and acknowledges the delivery only after that transaction committed. A redelivered
-- or republished copy finds the row and is skipped, so the effect is applied once per consumer.

CREATE TABLE processed_messages (
    consumer     text        NOT NULL CHECK (consumer <> ''),
    message_id   uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

COMMENT ON TABLE processed_messages IS 'Messages whose effect a consumer has committed: the deduplication record, written in the same transaction as the effect. Rows older than the consumer''s retention window are deleted in bounded batches.';
COMMENT ON COLUMN processed_messages.consumer IS 'Consumer name (consumer --name): scopes deduplication, so two different consumers of one message each apply their own effect once.';
COMMENT ON COLUMN processed_messages.message_id IS 'AMQP message_id of the delivery: the outbox row id, kept across redeliveries, retries and dead-letter replays.';
COMMENT ON COLUMN processed_messages.processed_at IS 'Start of the transaction that applied the effect; the retention sweep deletes rows older than the retention window, which must exceed the longest redelivery or replay horizon.';

-- The retention sweep reads the oldest rows; the primary key serves the per-message lookup.
CREATE INDEX processed_messages_processed_at_idx ON processed_messages (processed_at);

CREATE TABLE ledger_balances (
    account text   PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0,
    updates bigint NOT NULL DEFAULT 0
);

COMMENT ON TABLE ledger_balances IS 'Effect of the built-in example handler "ledger" (payment.captured events). Adding to a balance is deliberately not idempotent: deduplication keeps it right.';
COMMENT ON COLUMN ledger_balances.account IS 'Account named by the event payload field "account".';
COMMENT ON COLUMN ledger_balances.balance IS 'Sum of the "amount" fields of every payment.captured event applied to the account.';
COMMENT ON COLUMN ledger_balances.updates IS 'Number of events applied to the account: equals the number of distinct events when every effect was applied exactly once.';
