-- Notifications (issue 38): a second kind of remote call for the example, made by a consumer
-- (`producer notifier`), so the consumer side of an outage is shown against a real remote. The
-- simulator keeps each notification once per Idempotency-Key and counts how often it was posted.

CREATE TABLE provider.notifications (
    idempotency_key text        PRIMARY KEY
        CONSTRAINT notifications_key_length CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    body            jsonb       NOT NULL,
    posts           integer     NOT NULL DEFAULT 1 CHECK (posts >= 1),
    received_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
COMMENT ON TABLE provider.notifications IS
    'Every notification the simulator accepted (POST /notifications), once per Idempotency-Key; posts counts the deliveries of that key (replays included).';
COMMENT ON COLUMN provider.notifications.idempotency_key IS 'The caller''s Idempotency-Key (the example''s notifier sends the event''s message id): one notification per key.';
COMMENT ON COLUMN provider.notifications.body IS 'The notification as first posted (a JSON object).';
COMMENT ON COLUMN provider.notifications.posts IS 'How often the key was posted: 1, plus one for every repeat (a retry, a redelivery).';
COMMENT ON COLUMN provider.notifications.received_at IS 'When the first post was accepted.';
