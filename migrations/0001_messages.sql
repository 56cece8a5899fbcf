-- The transactional outbox and the relay's bookkeeping, in the product's own schema ({{schema}} is
-- the configured schema, `outbox` by default, quoted). Nothing is created outside it.
--
-- Producers only ever INSERT (aggregate_type, aggregate_id, event_type, payload[, id, headers]) into
-- messages. Every other column belongs to the relay and has a default.
--
-- What can never be published is refused at the door by named constraints, so that one producer's
-- mistake can never stop the relay. The same rules are in shared::publishable (Rust producers get a
-- typed error before touching the database) and in the relay's encoder (a row that gets past the
-- door anyway goes dead with its reason). They apply to pending rows: a dead row may break them
-- (that is why it is dead), and cannot be requeued before it is fixed.
CREATE FUNCTION {{schema}}.headers_flat_scalars(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN false ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_each(h) AS e(key, value)
        WHERE jsonb_typeof(e.value) NOT IN ('string', 'number', 'boolean')
           OR (jsonb_typeof(e.value) = 'number'
               AND abs((e.value #>> '{}')::numeric) > 1.7976931348623157e308)
    ) END
$$;
COMMENT ON FUNCTION {{schema}}.headers_flat_scalars(jsonb) IS 'True when headers is a JSON object whose values are strings, booleans or numbers a 64-bit float can hold: what AMQP headers can carry without nesting.';

CREATE FUNCTION {{schema}}.header_names_fit(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_object_keys(h) AS k(name)
        WHERE octet_length(k.name) NOT BETWEEN 1 AND 255
    ) END
$$;
COMMENT ON FUNCTION {{schema}}.header_names_fit(jsonb) IS 'True when every header name is 1 to 255 bytes: an AMQP short string.';

CREATE FUNCTION {{schema}}.header_names_not_reserved(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_object_keys(h) AS k(name)
        WHERE lower(k.name) IN ('cc', 'bcc', 'aggregate_type', 'aggregate_id', 'created_at')
           OR lower(k.name) LIKE 'x-%'
    ) END
$$;
COMMENT ON FUNCTION {{schema}}.header_names_not_reserved(jsonb) IS 'True when no header name is reserved: CC and BCC (RabbitMQ routes copies by them), x-* (RabbitMQ, its plugins and the consumer runtime give them meaning), and the headers the relay sets itself. Compared without regard to case.';

CREATE FUNCTION {{schema}}.headers_fit(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE (
        SELECT count(*) <= 256
           AND coalesce(sum(octet_length(e.key) + octet_length(e.value #>> '{}')), 0) <= 65536
        FROM jsonb_each(h) AS e(key, value)
    ) END
$$;
COMMENT ON FUNCTION {{schema}}.headers_fit(jsonb) IS 'True when headers has at most 256 entries and at most 64 KiB of names and values (values as text): with every other field at its maximum, the message properties stay well inside one AMQP frame.';

CREATE FUNCTION {{schema}}.unpublishable_reason(
    event_type text, aggregate_type text, aggregate_id text, created_at timestamptz, headers jsonb
) RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN octet_length(event_type) NOT BETWEEN 1 AND 255 THEN 'event_type must be 1 to 255 bytes (the AMQP routing key)'
        WHEN octet_length(aggregate_type) NOT BETWEEN 1 AND 255 THEN 'aggregate_type must be 1 to 255 bytes'
        WHEN octet_length(aggregate_id) > 1024 THEN 'aggregate_id must be at most 1024 bytes'
        WHEN NOT isfinite(created_at) THEN 'created_at must be a finite time'
        WHEN NOT {{schema}}.headers_flat_scalars(headers) THEN 'headers must be a flat object of strings, numbers and booleans'
        WHEN NOT {{schema}}.header_names_fit(headers) THEN 'header names must be 1 to 255 bytes'
        WHEN NOT {{schema}}.header_names_not_reserved(headers) THEN 'header names CC, BCC, x-*, aggregate_type, aggregate_id and created_at are reserved'
        WHEN NOT {{schema}}.headers_fit(headers) THEN 'headers must have at most 256 entries and 64 KiB of names and values'
    END
$$;
COMMENT ON FUNCTION {{schema}}.unpublishable_reason(text, text, text, timestamptz, jsonb) IS 'NULL when a message meets every publishability rule, else the first rule it breaks; relay dead requeue leaves such rows dead.';

CREATE TABLE {{schema}}.messages (
    seq             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id              uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    partition       smallint    GENERATED ALWAYS AS ((hashtextextended(aggregate_id, 0) & 63)::smallint) STORED,
    state           text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'published', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error      text,
    last_attempt_at timestamptz,
    published_at    timestamptz,
    CONSTRAINT messages_published_has_time CHECK ((state = 'published') = (published_at IS NOT NULL)),
    CONSTRAINT messages_event_type_is_amqp_short_string
        CHECK (state <> 'pending' OR octet_length(event_type) BETWEEN 1 AND 255),
    CONSTRAINT messages_aggregate_type_is_amqp_short_string
        CHECK (state <> 'pending' OR octet_length(aggregate_type) BETWEEN 1 AND 255),
    CONSTRAINT messages_aggregate_id_at_most_1024_bytes
        CHECK (state <> 'pending' OR octet_length(aggregate_id) <= 1024),
    CONSTRAINT messages_created_at_is_finite
        CHECK (state <> 'pending' OR isfinite(created_at)),
    CONSTRAINT messages_headers_flat_object_of_scalars
        CHECK (state <> 'pending' OR {{schema}}.headers_flat_scalars(headers)),
    CONSTRAINT messages_header_names_are_amqp_short_strings
        CHECK (state <> 'pending' OR {{schema}}.header_names_fit(headers)),
    CONSTRAINT messages_header_names_not_reserved
        CHECK (state <> 'pending' OR {{schema}}.header_names_not_reserved(headers)),
    CONSTRAINT messages_headers_at_most_256_entries_and_64_kib
        CHECK (state <> 'pending' OR {{schema}}.headers_fit(headers))
);

COMMENT ON TABLE {{schema}}.messages IS 'Transactional outbox: producers insert events in the same transaction as their business change; the relay publishes committed rows to RabbitMQ and removes them after the broker confirmed.';
COMMENT ON COLUMN {{schema}}.messages.seq IS 'Outbox position, taken at INSERT. Within an aggregate the relay publishes in seq order, which is commit order for transactions that are serialized on the aggregate.';
COMMENT ON COLUMN {{schema}}.messages.id IS 'Message id (AMQP message_id); consumers deduplicate on it. Defaults to a random UUID; the Rust producer API sets a UUIDv7.';
COMMENT ON COLUMN {{schema}}.messages.aggregate_type IS 'Kind of entity the event is about (order, payment), 1 to 255 bytes; sent as AMQP header aggregate_type.';
COMMENT ON COLUMN {{schema}}.messages.aggregate_id IS 'Entity id, at most 1024 bytes; the ordering key: events of one aggregate_id are published in order. Sent as AMQP header aggregate_id.';
COMMENT ON COLUMN {{schema}}.messages.event_type IS 'Event name (order.placed); the AMQP routing key and type property: 1 to 255 bytes.';
COMMENT ON COLUMN {{schema}}.messages.payload IS 'Event body, published as application/json.';
COMMENT ON COLUMN {{schema}}.messages.headers IS 'Optional flat JSON object of strings, numbers and booleans (traceparent, correlation id, tenant) sent as AMQP headers: at most 256 entries and 64 KiB; names 1 to 255 bytes, not CC, BCC, x-*, aggregate_type, aggregate_id or created_at.';
COMMENT ON COLUMN {{schema}}.messages.created_at IS 'Insert time (clock_timestamp, not transaction start), finite; AMQP timestamp property and the start of the publish latency metric.';
COMMENT ON COLUMN {{schema}}.messages.partition IS 'Hash partition of aggregate_id (64 partitions). One relay at a time owns a partition; a failing row holds back only its partition.';
COMMENT ON COLUMN {{schema}}.messages.state IS 'pending: waiting to be published; published: confirmed by the broker, kept only while a retention is configured; dead: gave up after max attempts, see relay dead list.';
COMMENT ON COLUMN {{schema}}.messages.attempts IS 'Failed publish attempts so far (nack, return, confirm timeout, lost connection).';
COMMENT ON COLUMN {{schema}}.messages.last_error IS 'Reason of the last failed attempt.';
COMMENT ON COLUMN {{schema}}.messages.last_attempt_at IS 'Time of the last failed attempt.';
COMMENT ON COLUMN {{schema}}.messages.published_at IS 'Time the broker confirmed the row; set only when published rows are retained.';

-- The claim reads the head of each owned partition in seq order: shaped exactly for that,
-- and partial so that retained published and dead rows cost the claim nothing.
CREATE INDEX messages_claim_idx ON {{schema}}.messages (partition, seq) WHERE state = 'pending';
-- Retention sweep of published rows and the dead-row listing.
CREATE INDEX messages_published_idx ON {{schema}}.messages (published_at) WHERE state = 'published';
CREATE INDEX messages_dead_idx ON {{schema}}.messages (seq) WHERE state = 'dead';
CREATE UNIQUE INDEX messages_id_idx ON {{schema}}.messages (id);

-- One NOTIFY per producer statement, not per row: wakes the relays.
CREATE FUNCTION {{schema}}.messages_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.messages', '');
    RETURN NULL;
END;
$$;
COMMENT ON FUNCTION {{schema}}.messages_notify() IS 'Statement-level trigger function: wakes the relays listening on channel <schema>.messages once per INSERT statement; delivered at commit, dropped on rollback.';

CREATE TRIGGER messages_notify_insert
    AFTER INSERT ON {{schema}}.messages
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.messages_notify();

CREATE TABLE {{schema}}.relay_partitions (
    partition     smallint    PRIMARY KEY CHECK (partition BETWEEN 0 AND 63),
    owner         text,
    lease_until   timestamptz NOT NULL DEFAULT '-infinity',
    blocked_until timestamptz,
    blocked_seq   bigint,
    CONSTRAINT relay_partitions_blocked CHECK ((blocked_until IS NULL) = (blocked_seq IS NULL))
);
COMMENT ON TABLE {{schema}}.relay_partitions IS 'Ownership of the 64 messages partitions: exactly one live relay publishes a partition, so rows of one aggregate go out in order.';
COMMENT ON COLUMN {{schema}}.relay_partitions.partition IS 'Partition number, matches messages.partition.';
COMMENT ON COLUMN {{schema}}.relay_partitions.owner IS 'Instance id of the relay holding the lease; NULL when free.';
COMMENT ON COLUMN {{schema}}.relay_partitions.lease_until IS 'Lease expiry (database clock). Another relay may take the partition once it has passed: the takeover bound after a crash.';
COMMENT ON COLUMN {{schema}}.relay_partitions.blocked_until IS 'Set when a row of this partition failed: nothing of the partition is published before this time (retry backoff), so order holds.';
COMMENT ON COLUMN {{schema}}.relay_partitions.blocked_seq IS 'The failed row that blocks the partition.';

INSERT INTO {{schema}}.relay_partitions (partition) SELECT generate_series(0, 63);

CREATE TABLE {{schema}}.relay_instances (
    instance_id  text        PRIMARY KEY,
    hostname     text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {{schema}}.relay_instances IS 'Live relays; used to share partitions evenly. Rows whose heartbeat is older than the lease are ignored and swept.';
COMMENT ON COLUMN {{schema}}.relay_instances.instance_id IS 'Random id chosen by a relay process at start.';
COMMENT ON COLUMN {{schema}}.relay_instances.hostname IS 'Host the relay runs on, for operators.';
COMMENT ON COLUMN {{schema}}.relay_instances.started_at IS 'Process start.';
COMMENT ON COLUMN {{schema}}.relay_instances.heartbeat_at IS 'Last lease renewal of this relay.';
