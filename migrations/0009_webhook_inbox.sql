-- The webhook inbox (the `idempotency` crate's webhooks module): any service that receives
-- signed webhooks records every verified event here, unique by (source, event id), in the same
-- transaction as the event's effect; a second delivery finds the row and changes nothing.
-- webhook_objects keeps, per object, the highest position applied, so an older event arriving
-- after a newer one is recorded as superseded instead of moving the object backwards.

CREATE TABLE {{schema}}.webhook_inbox (
    source      text        NOT NULL CHECK (octet_length(source) BETWEEN 1 AND 200),
    event_id    text        NOT NULL CHECK (octet_length(event_id) BETWEEN 1 AND 255),
    event_type  text        NOT NULL CHECK (octet_length(event_type) BETWEEN 1 AND 255),
    object_key  text        CHECK (octet_length(object_key) BETWEEN 1 AND 255),
    position    bigint,
    outcome     text        NOT NULL CHECK (outcome IN ('applied', 'superseded')),
    occurred_at timestamptz,
    signed_at   timestamptz NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    payload     text        NOT NULL,
    PRIMARY KEY (source, event_id),
    CONSTRAINT webhook_inbox_position_has_object CHECK ((position IS NULL) = (object_key IS NULL))
);

COMMENT ON TABLE {{schema}}.webhook_inbox IS 'Every verified webhook event a service received, once per (source, event id), written in the transaction of its effect: the deduplication record of webhooks, as processed_messages is of deliveries.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.source IS 'Who sent it, as the receiver is named (e.g. provider): scopes event ids, so two providers'' ids never collide.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.event_id IS 'The provider''s event id (the body''s id); a redelivery carries the same one.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.event_type IS 'The body''s type (e.g. charge.succeeded).';
COMMENT ON COLUMN {{schema}}.webhook_inbox.object_key IS 'The object the event is about, as the service''s handler names it (by default data.object.id); NULL when the service does not order this source''s events.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.position IS 'The event''s place in its object''s history as the service ranks it (a state rank, a version, a time); compared with webhook_objects.position.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.outcome IS 'applied: the handler ran and its effect committed with this row; superseded: the object already had this position or a higher one, the handler did not run.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.occurred_at IS 'The event''s own time (the body''s created), if it had one.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.signed_at IS 'The signature''s timestamp of the delivery that was recorded.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.received_at IS 'Start of the transaction that recorded it.';
COMMENT ON COLUMN {{schema}}.webhook_inbox.payload IS 'The body exactly as signed (JSON text), for audit and for code that reads events later (a process waiting for one).';

CREATE INDEX webhook_inbox_object_idx ON {{schema}}.webhook_inbox (source, object_key, received_at)
    WHERE object_key IS NOT NULL;
CREATE INDEX webhook_inbox_received_at_idx ON {{schema}}.webhook_inbox (received_at);

CREATE TABLE {{schema}}.webhook_objects (
    source     text        NOT NULL CHECK (octet_length(source) BETWEEN 1 AND 200),
    object_key text        NOT NULL CHECK (octet_length(object_key) BETWEEN 1 AND 255),
    position   bigint      NOT NULL,
    event_id   text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, object_key)
);

COMMENT ON TABLE {{schema}}.webhook_objects IS 'Per object, the highest position a webhook event applied: an event of the same object with a position not above it is superseded. Its row lock orders concurrent events of one object.';
COMMENT ON COLUMN {{schema}}.webhook_objects.source IS 'The receiver''s name, as in webhook_inbox.';
COMMENT ON COLUMN {{schema}}.webhook_objects.object_key IS 'The object''s id, as the handler names it.';
COMMENT ON COLUMN {{schema}}.webhook_objects.position IS 'The highest position applied so far.';
COMMENT ON COLUMN {{schema}}.webhook_objects.event_id IS 'The event that applied it.';
COMMENT ON COLUMN {{schema}}.webhook_objects.updated_at IS 'When it was last moved forward.';
