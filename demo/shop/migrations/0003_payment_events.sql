-- The provider's webhook events about the demo's payments, as POST /webhooks/provider records
-- them (the idempotency crate's receiver: the product's webhook_inbox row and this row commit
-- together, once per event). A charge's reference is the payment's id.

CREATE TABLE demo.payment_events (
    event_id      text        PRIMARY KEY CHECK (length(event_id) BETWEEN 1 AND 255),
    payment_id    uuid        REFERENCES demo.payments (id),
    charge_id     uuid        NOT NULL,
    type          text        NOT NULL CHECK (length(type) BETWEEN 1 AND 255),
    charge_status text        NOT NULL CHECK (length(charge_status) BETWEEN 1 AND 50),
    amount        bigint      NOT NULL,
    currency      text        NOT NULL,
    occurred_at   timestamptz,
    received_at   timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE demo.payment_events IS 'Webhook events of the payment provider (charge.succeeded, charge.failed, charge.refunded) that were applied, one row per event, written in the transaction of its {{schema}}.webhook_inbox row. Superseded (older) events are in the inbox only.';
COMMENT ON COLUMN demo.payment_events.event_id IS 'The provider''s event id (as in {{schema}}.webhook_inbox).';
COMMENT ON COLUMN demo.payment_events.payment_id IS 'The payment whose id is the charge''s reference; NULL when the reference is no payment of this shop.';
COMMENT ON COLUMN demo.payment_events.charge_id IS 'The provider''s charge id.';
COMMENT ON COLUMN demo.payment_events.type IS 'The event type.';
COMMENT ON COLUMN demo.payment_events.charge_status IS 'The charge''s status the event reported (succeeded, declined, refunded).';
COMMENT ON COLUMN demo.payment_events.amount IS 'The charge''s amount in minor units, as the provider reported it.';
COMMENT ON COLUMN demo.payment_events.currency IS 'The charge''s currency, as the provider reported it.';
COMMENT ON COLUMN demo.payment_events.occurred_at IS 'When the provider says it happened (the event''s created).';
COMMENT ON COLUMN demo.payment_events.received_at IS 'When it was recorded.';

CREATE INDEX payment_events_payment_idx ON demo.payment_events (payment_id, received_at);
