-- Consumer-side bookkeeping: per-consumer deduplication.
--
-- A consumer applies an event's effect and records (consumer, message_id) here in the same
-- transaction, and acknowledges the delivery only after that transaction committed. A redelivered
-- or republished copy finds the row and is skipped, so the effect is applied once per consumer.

CREATE TABLE {{schema}}.processed_messages (
    consumer     text        NOT NULL CHECK (consumer <> ''),
    message_id   uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

COMMENT ON TABLE {{schema}}.processed_messages IS 'Messages whose effect a consumer has committed: the deduplication record, written in the same transaction as the effect. Rows older than the consumer''s retention window are deleted in bounded batches.';
COMMENT ON COLUMN {{schema}}.processed_messages.consumer IS 'Consumer name (consumer --name): scopes deduplication, so two different consumers of one message each apply their own effect once.';
COMMENT ON COLUMN {{schema}}.processed_messages.message_id IS 'AMQP message_id of the delivery: the outbox row id, kept across redeliveries, retries and dead-letter replays.';
COMMENT ON COLUMN {{schema}}.processed_messages.processed_at IS 'Start of the transaction that applied the effect; the retention sweep deletes rows older than the retention window, which must exceed the longest redelivery or replay horizon.';

-- The retention sweep reads the oldest rows; the primary key serves the per-message lookup.
CREATE INDEX processed_messages_processed_at_idx ON {{schema}}.processed_messages (processed_at);
