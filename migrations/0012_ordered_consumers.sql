-- Ordered consumers (issue 22): a consumer in ordered mode applies each aggregate's messages in
-- aggregate_seq order, across any number of instances.
--
-- Routing: the relay sets header aggregate_partition (messages.partition, 0..63); an ordered
-- consumer's headers exchange splits its traffic over its partition queues by it, so one
-- aggregate always lands in one queue. Its tables, all owned by the consumer runtime
-- (consumer::ordered):
-- - consumer_groups: the consumer's partition count, fixed by its first instance;
-- - consumer_partitions: which live instance consumes which partition queue (lease + epoch: the
--   fence every apply transaction checks);
-- - consumer_instances: live instances (heartbeats), for the fair share;
-- - consumer_positions: per aggregate, the last applied aggregate_seq, retries and parking;
-- - consumer_held: messages that arrived ahead of a gap, or behind a failing or parked head,
--   kept durably (the delivery is acknowledged once its row is committed).

-- 1. The relay's new header is reserved, like the other headers it sets.
CREATE OR REPLACE FUNCTION {{schema}}.header_names_not_reserved(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_object_keys(h) AS k(name)
        WHERE lower(k.name) IN ('cc', 'bcc', 'aggregate_type', 'aggregate_id', 'aggregate_seq',
                                'aggregate_partition', 'created_at')
           OR lower(k.name) LIKE 'x-%'
           OR lower(k.name) LIKE 'cloudevents\_%'
           OR lower(k.name) LIKE 'cloudevents:%'
    ) END
$$;
UPDATE {{schema}}.messages
SET state = 'dead', last_error = 'unpublishable: header name aggregate_partition is reserved since migration 12', last_attempt_at = now()
WHERE state = 'pending' AND NOT {{schema}}.header_names_not_reserved(headers);

CREATE OR REPLACE FUNCTION {{schema}}.unpublishable_reason(
    event_type text, aggregate_type text, aggregate_id text, created_at timestamptz, headers jsonb
) RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN octet_length(event_type) NOT BETWEEN 1 AND 255 THEN 'event_type must be 1 to 255 bytes (the AMQP routing key)'
        WHEN octet_length(aggregate_type) NOT BETWEEN 1 AND 255 THEN 'aggregate_type must be 1 to 255 bytes'
        WHEN octet_length(aggregate_id) > 1024 THEN 'aggregate_id must be at most 1024 bytes'
        WHEN NOT isfinite(created_at) THEN 'created_at must be a finite time'
        WHEN NOT {{schema}}.headers_flat_scalars(headers) THEN 'headers must be a flat object of strings, numbers and booleans'
        WHEN NOT {{schema}}.header_names_fit(headers) THEN 'header names must be 1 to 255 bytes'
        WHEN NOT {{schema}}.header_names_not_reserved(headers) THEN 'header names CC, BCC, x-*, cloudEvents_*, cloudEvents:*, aggregate_type, aggregate_id, aggregate_seq, aggregate_partition and created_at are reserved'
        WHEN NOT {{schema}}.headers_fit(headers) THEN 'headers must have at most 256 entries and 64 KiB of names and values'
    END
$$;

-- 2. The consumer group: partition count and leases.
CREATE TABLE {{schema}}.consumer_groups (
    consumer    text        PRIMARY KEY CHECK (octet_length(consumer) BETWEEN 1 AND 200),
    partitions  smallint    NOT NULL CHECK (partitions BETWEEN 1 AND 64),
    created_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {{schema}}.consumer_groups IS 'One row per ordered consumer: its partition count, fixed by the first instance (every instance must be started with the same count; the queues NAME.ordered.0..N-1 exist for it).';

CREATE TABLE {{schema}}.consumer_partitions (
    consumer     text        NOT NULL REFERENCES {{schema}}.consumer_groups (consumer) ON DELETE CASCADE,
    partition    smallint    NOT NULL CHECK (partition BETWEEN 0 AND 63),
    owner        text,
    epoch        bigint      NOT NULL DEFAULT 0 CHECK (epoch >= 0),
    lease_until  timestamptz NOT NULL DEFAULT '-infinity',
    PRIMARY KEY (consumer, partition)
);
COMMENT ON TABLE {{schema}}.consumer_partitions IS 'Which instance consumes which partition queue of an ordered consumer. Every apply transaction locks its row (FOR SHARE) and checks owner, epoch and lease: an instance that lost the partition (paused, cut off) cannot apply anything after.';
COMMENT ON COLUMN {{schema}}.consumer_partitions.epoch IS 'Raised each time the partition changes hands: the fence a transaction carries.';
COMMENT ON COLUMN {{schema}}.consumer_partitions.lease_until IS 'Lease expiry (database clock); another instance may take the partition once it has passed.';

CREATE TABLE {{schema}}.consumer_instances (
    consumer      text        NOT NULL,
    instance_id   text        NOT NULL,
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, instance_id)
);
COMMENT ON TABLE {{schema}}.consumer_instances IS 'Live instances of ordered consumers (heartbeat every quarter lease), for the fair share of partitions; rows older than ten leases are swept.';

-- 3. Positions and held messages.
CREATE TABLE {{schema}}.consumer_positions (
    consumer        text        NOT NULL,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    partition       smallint    NOT NULL CHECK (partition BETWEEN 0 AND 63),
    applied_seq     bigint      NOT NULL DEFAULT 0 CHECK (applied_seq >= 0),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    retry_at        timestamptz,
    last_error      text,
    parked_at       timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id),
    CONSTRAINT consumer_positions_parked_has_reason CHECK (parked_at IS NULL OR last_error IS NOT NULL)
);
COMMENT ON TABLE {{schema}}.consumer_positions IS 'Per ordered consumer and aggregate: the last aggregate_seq applied (its effect committed in the same transaction as this row), and the state of the head message when it failed.';
COMMENT ON COLUMN {{schema}}.consumer_positions.applied_seq IS 'Last applied aggregate_seq; the next one applied is applied_seq + 1.';
COMMENT ON COLUMN {{schema}}.consumer_positions.attempts IS 'Failed attempts of the head message (applied_seq + 1); reset when it is applied.';
COMMENT ON COLUMN {{schema}}.consumer_positions.retry_at IS 'The head failed transiently: it is tried again (from consumer_held) at this time.';
COMMENT ON COLUMN {{schema}}.consumer_positions.parked_at IS 'Attempts ran out or the failure was permanent: the head and everything after it stay held until an operator retries, skips or dead-letters.';

-- Parked aggregates, listed by the console and the metric.
CREATE INDEX consumer_positions_parked_idx ON {{schema}}.consumer_positions (consumer, parked_at)
    WHERE parked_at IS NOT NULL;
-- The retry sweep: failing heads due again.
CREATE INDEX consumer_positions_retry_idx ON {{schema}}.consumer_positions (consumer, partition, retry_at)
    WHERE retry_at IS NOT NULL AND parked_at IS NULL;

CREATE TABLE {{schema}}.consumer_held (
    consumer        text        NOT NULL,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    aggregate_seq   bigint      NOT NULL CHECK (aggregate_seq > 0),
    partition       smallint    NOT NULL CHECK (partition BETWEEN 0 AND 63),
    message_id      uuid        NOT NULL,
    envelope        jsonb       NOT NULL,
    held_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id, aggregate_seq)
);
COMMENT ON TABLE {{schema}}.consumer_held IS 'Messages an ordered consumer received but may not apply yet: ahead of a gap (a predecessor not arrived), or behind a failing or parked head. Applied (and deleted) in order as soon as their turn comes.';
COMMENT ON COLUMN {{schema}}.consumer_held.envelope IS 'The decoded message (shared::Envelope as JSON), applied from here.';

-- The gap report: held messages waiting longest, per partition.
CREATE INDEX consumer_held_age_idx ON {{schema}}.consumer_held (consumer, partition, held_at);
