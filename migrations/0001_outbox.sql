-- The transactional outbox and the relay's bookkeeping.
--
-- Producers only ever INSERT (aggregate_type, aggregate_id, event_type, payload[, id, headers]).
-- Every other column belongs to the relay and has a default.

CREATE TABLE outbox (
    seq             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id              uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type  text        NOT NULL CHECK (aggregate_type <> ''),
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL CHECK (event_type <> '' AND length(event_type) <= 255),
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(headers) = 'object'),
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    partition       smallint    GENERATED ALWAYS AS ((hashtextextended(aggregate_id, 0) & 63)::smallint) STORED,
    state           text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'published', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error      text,
    last_attempt_at timestamptz,
    published_at    timestamptz,
    CONSTRAINT outbox_published_has_time CHECK ((state = 'published') = (published_at IS NOT NULL))
);

COMMENT ON TABLE outbox IS 'Transactional outbox: producers insert events in the same transaction as their business change; the relay publishes committed rows to RabbitMQ and removes them after the broker confirmed.';
COMMENT ON COLUMN outbox.seq IS 'Outbox position, taken at INSERT. Within an aggregate the relay publishes in seq order, which is commit order for transactions that are serialized on the aggregate.';
COMMENT ON COLUMN outbox.id IS 'Message id (AMQP message_id); consumers deduplicate on it. Defaults to a random UUID; the Rust producer API sets a UUIDv7.';
COMMENT ON COLUMN outbox.aggregate_type IS 'Kind of entity the event is about (order, payment); sent as AMQP header aggregate_type.';
COMMENT ON COLUMN outbox.aggregate_id IS 'Entity id; the ordering key: events of one aggregate_id are published in order. Sent as AMQP header aggregate_id.';
COMMENT ON COLUMN outbox.event_type IS 'Event name (order.placed); the AMQP routing key and type property.';
COMMENT ON COLUMN outbox.payload IS 'Event body, published as application/json.';
COMMENT ON COLUMN outbox.headers IS 'Optional flat JSON object (traceparent, correlation id, tenant) sent as AMQP headers.';
COMMENT ON COLUMN outbox.created_at IS 'Insert time (clock_timestamp, not transaction start); AMQP timestamp property and the start of the publish latency metric.';
COMMENT ON COLUMN outbox.partition IS 'Hash partition of aggregate_id (64 partitions). One relay at a time owns a partition; a failing row holds back only its partition.';
COMMENT ON COLUMN outbox.state IS 'pending: waiting to be published; published: confirmed by the broker, kept only while a retention is configured; dead: gave up after max attempts, see relay dead list.';
COMMENT ON COLUMN outbox.attempts IS 'Failed publish attempts so far (nack, return, confirm timeout, lost connection).';
COMMENT ON COLUMN outbox.last_error IS 'Reason of the last failed attempt.';
COMMENT ON COLUMN outbox.last_attempt_at IS 'Time of the last failed attempt.';
COMMENT ON COLUMN outbox.published_at IS 'Time the broker confirmed the row; set only when published rows are retained.';

-- The claim reads the head of each owned partition in seq order: shaped exactly for that,
-- and partial so that retained published and dead rows cost the claim nothing.
CREATE INDEX outbox_claim_idx ON outbox (partition, seq) WHERE state = 'pending';
-- Retention sweep of published rows and the dead-row listing.
CREATE INDEX outbox_published_idx ON outbox (published_at) WHERE state = 'published';
CREATE INDEX outbox_dead_idx ON outbox (seq) WHERE state = 'dead';
CREATE UNIQUE INDEX outbox_id_idx ON outbox (id);

-- One NOTIFY per producer statement, not per row: wakes the relays.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox', '');
    RETURN NULL;
END;
$$;
COMMENT ON FUNCTION outbox_notify() IS 'Statement-level trigger function: wakes listening relays once per INSERT statement; delivered at commit, dropped on rollback.';

CREATE TRIGGER outbox_notify_insert
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

CREATE TABLE relay_partitions (
    partition     smallint    PRIMARY KEY CHECK (partition BETWEEN 0 AND 63),
    owner         text,
    lease_until   timestamptz NOT NULL DEFAULT '-infinity',
    blocked_until timestamptz,
    blocked_seq   bigint,
    CONSTRAINT relay_partitions_blocked CHECK ((blocked_until IS NULL) = (blocked_seq IS NULL))
);
COMMENT ON TABLE relay_partitions IS 'Ownership of the 64 outbox partitions: exactly one live relay publishes a partition, so rows of one aggregate go out in order.';
COMMENT ON COLUMN relay_partitions.partition IS 'Partition number, matches outbox.partition.';
COMMENT ON COLUMN relay_partitions.owner IS 'Instance id of the relay holding the lease; NULL when free.';
COMMENT ON COLUMN relay_partitions.lease_until IS 'Lease expiry (database clock). Another relay may take the partition once it has passed: the takeover bound after a crash.';
COMMENT ON COLUMN relay_partitions.blocked_until IS 'Set when a row of this partition failed: nothing of the partition is published before this time (retry backoff), so order holds.';
COMMENT ON COLUMN relay_partitions.blocked_seq IS 'The failed row that blocks the partition.';

INSERT INTO relay_partitions (partition) SELECT generate_series(0, 63);

CREATE TABLE relay_instances (
    instance_id  text        PRIMARY KEY,
    hostname     text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE relay_instances IS 'Live relays; used to share partitions evenly. Rows whose heartbeat is older than the lease are ignored and swept.';
COMMENT ON COLUMN relay_instances.instance_id IS 'Random id chosen by a relay process at start.';
COMMENT ON COLUMN relay_instances.hostname IS 'Host the relay runs on, for operators.';
COMMENT ON COLUMN relay_instances.started_at IS 'Process start.';
COMMENT ON COLUMN relay_instances.heartbeat_at IS 'Last lease renewal of this relay.';
