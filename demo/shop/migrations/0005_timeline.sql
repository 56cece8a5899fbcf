-- The example consumer `producer timeline` (issue 22, ordered consumers): one row per event it
-- applied, written in the transaction of that event's deduplication row, so the order in which a
-- consumer applied each aggregate's events can be read from outside. A message applied twice
-- shows as two rows (no unique constraint), never as an error.

CREATE TABLE demo.timeline (
    position       bigserial   PRIMARY KEY,
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    aggregate_seq  bigint,
    message_id     uuid        NOT NULL,
    event_type     text        NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- Not unique: a bug that applies an event twice, or out of order, must show in the rows.
CREATE INDEX timeline_aggregate_idx
    ON demo.timeline (consumer, aggregate_type, aggregate_id, aggregate_seq);
COMMENT ON TABLE demo.timeline IS 'Effect of the example handler "timeline" (producer timeline): one row per event a consumer applied, in the transaction of its deduplication row. Rows of one aggregate in position order are the order in which that consumer applied its events. Not unique: an event applied twice has two rows.';
COMMENT ON COLUMN demo.timeline.position IS 'Order of application. Taken at insert, not at commit: sound here because the consumer runtime (ordered mode) applies one aggregate''s effects in one transaction, in order, or one transaction after the other''s commit, so within an aggregate insert order is commit order. (Unordered, concurrent workers may commit in another order than they inserted.) Across aggregates it means nothing; gaps are rolled-back inserts.';
COMMENT ON COLUMN demo.timeline.consumer IS 'The consumer''s name (--name), which scopes deduplication.';
COMMENT ON COLUMN demo.timeline.aggregate_type IS 'The event''s aggregate_type header.';
COMMENT ON COLUMN demo.timeline.aggregate_id IS 'The event''s aggregate_id header.';
COMMENT ON COLUMN demo.timeline.aggregate_seq IS 'The event''s aggregate_seq header (1, 2, 3, ... per aggregate in the producer''s commit order); NULL for a message published before the relay set it.';
COMMENT ON COLUMN demo.timeline.message_id IS 'The event''s message_id (the outbox row''s id).';
COMMENT ON COLUMN demo.timeline.event_type IS 'The event''s type (its routing key).';
COMMENT ON COLUMN demo.timeline.applied_at IS 'Wall-clock time of the insert (clock_timestamp(), not the transaction''s start).';
