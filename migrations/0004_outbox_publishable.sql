-- Refuse at the door what can never be published, so that one producer's mistake can never stop
-- the relay. The same rules are in shared::publishable (Rust producers get a typed error before
-- touching the database) and in the relay's encoder (a row that gets past the door anyway goes dead
-- with its reason). Each constraint is named after the rule it enforces.
--
-- The rules apply to pending rows: a dead row may break them (that is why it is dead), and cannot
-- be requeued before it is fixed.

CREATE FUNCTION outbox_headers_flat_scalars(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN false ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_each(h) AS e(key, value)
        WHERE jsonb_typeof(e.value) NOT IN ('string', 'number', 'boolean')
           OR (jsonb_typeof(e.value) = 'number'
               AND abs((e.value #>> '{}')::numeric) > 1.7976931348623157e308)
    ) END
$$;
COMMENT ON FUNCTION outbox_headers_flat_scalars(jsonb) IS 'True when headers is a JSON object whose values are strings, booleans or numbers a 64-bit float can hold: what AMQP headers can carry without nesting.';

CREATE FUNCTION outbox_header_names_fit(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_object_keys(h) AS k(name)
        WHERE octet_length(k.name) NOT BETWEEN 1 AND 255
    ) END
$$;
COMMENT ON FUNCTION outbox_header_names_fit(jsonb) IS 'True when every header name is 1 to 255 bytes: an AMQP short string.';

CREATE FUNCTION outbox_header_names_not_reserved(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_object_keys(h) AS k(name)
        WHERE lower(k.name) IN ('cc', 'bcc', 'aggregate_type', 'aggregate_id', 'created_at')
           OR lower(k.name) LIKE 'x-%'
    ) END
$$;
COMMENT ON FUNCTION outbox_header_names_not_reserved(jsonb) IS 'True when no header name is reserved: CC and BCC (RabbitMQ routes copies by them), x-* (RabbitMQ, its plugins and the consumer runtime give them meaning), and the headers the relay sets itself. Compared without regard to case.';

CREATE FUNCTION outbox_headers_fit(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE (
        SELECT count(*) <= 256
           AND coalesce(sum(octet_length(e.key) + octet_length(e.value #>> '{}')), 0) <= 65536
        FROM jsonb_each(h) AS e(key, value)
    ) END
$$;
COMMENT ON FUNCTION outbox_headers_fit(jsonb) IS 'True when headers has at most 256 entries and at most 64 KiB of names and values (values as text): with every other field at its maximum, the message properties stay well inside one AMQP frame.';

CREATE FUNCTION outbox_unpublishable_reason(
    event_type text, aggregate_type text, aggregate_id text, created_at timestamptz, headers jsonb
) RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN octet_length(event_type) NOT BETWEEN 1 AND 255 THEN 'event_type must be 1 to 255 bytes (the AMQP routing key)'
        WHEN octet_length(aggregate_type) NOT BETWEEN 1 AND 255 THEN 'aggregate_type must be 1 to 255 bytes'
        WHEN octet_length(aggregate_id) > 1024 THEN 'aggregate_id must be at most 1024 bytes'
        WHEN NOT isfinite(created_at) THEN 'created_at must be a finite time'
        WHEN NOT outbox_headers_flat_scalars(headers) THEN 'headers must be a flat object of strings, numbers and booleans'
        WHEN NOT outbox_header_names_fit(headers) THEN 'header names must be 1 to 255 bytes'
        WHEN NOT outbox_header_names_not_reserved(headers) THEN 'header names CC, BCC, x-*, aggregate_type, aggregate_id and created_at are reserved'
        WHEN NOT outbox_headers_fit(headers) THEN 'headers must have at most 256 entries and 64 KiB of names and values'
    END
$$;
COMMENT ON FUNCTION outbox_unpublishable_reason(text, text, text, timestamptz, jsonb) IS 'NULL when a message meets every publishability rule, else the first rule it breaks; relay dead requeue leaves such rows dead.';

-- Rows already pending that break a rule could never be published: they go dead with the reason,
-- so they hold nothing back and adding the constraints cannot fail.
UPDATE outbox SET state = 'dead', attempts = attempts + 1, last_attempt_at = now(),
       last_error = 'unpublishable: ' || outbox_unpublishable_reason(event_type, aggregate_type, aggregate_id, created_at, headers)
 WHERE state = 'pending'
   AND outbox_unpublishable_reason(event_type, aggregate_type, aggregate_id, created_at, headers) IS NOT NULL;

ALTER TABLE outbox
    DROP CONSTRAINT outbox_event_type_check,
    DROP CONSTRAINT outbox_aggregate_type_check,
    DROP CONSTRAINT outbox_headers_check,
    ADD CONSTRAINT messages_event_type_is_amqp_short_string
        CHECK (state <> 'pending' OR octet_length(event_type) BETWEEN 1 AND 255),
    ADD CONSTRAINT messages_aggregate_type_is_amqp_short_string
        CHECK (state <> 'pending' OR octet_length(aggregate_type) BETWEEN 1 AND 255),
    ADD CONSTRAINT messages_aggregate_id_at_most_1024_bytes
        CHECK (state <> 'pending' OR octet_length(aggregate_id) <= 1024),
    ADD CONSTRAINT messages_created_at_is_finite
        CHECK (state <> 'pending' OR isfinite(created_at)),
    ADD CONSTRAINT messages_headers_flat_object_of_scalars
        CHECK (state <> 'pending' OR outbox_headers_flat_scalars(headers)),
    ADD CONSTRAINT messages_header_names_are_amqp_short_strings
        CHECK (state <> 'pending' OR outbox_header_names_fit(headers)),
    ADD CONSTRAINT messages_header_names_not_reserved
        CHECK (state <> 'pending' OR outbox_header_names_not_reserved(headers)),
    ADD CONSTRAINT messages_headers_at_most_256_entries_and_64_kib
        CHECK (state <> 'pending' OR outbox_headers_fit(headers));

COMMENT ON COLUMN outbox.event_type IS 'Event name (order.placed); the AMQP routing key and type property: 1 to 255 bytes.';
COMMENT ON COLUMN outbox.aggregate_type IS 'Kind of entity the event is about (order, payment), 1 to 255 bytes; sent as AMQP header aggregate_type.';
COMMENT ON COLUMN outbox.aggregate_id IS 'Entity id, at most 1024 bytes; the ordering key: events of one aggregate_id are published in order. Sent as AMQP header aggregate_id.';
COMMENT ON COLUMN outbox.headers IS 'Optional flat JSON object of strings, numbers and booleans (traceparent, correlation id, tenant) sent as AMQP headers: at most 256 entries and 64 KiB; names 1 to 255 bytes, not CC, BCC, x-*, aggregate_type, aggregate_id or created_at.';
COMMENT ON COLUMN outbox.created_at IS 'Insert time (clock_timestamp, not transaction start), finite; AMQP timestamp property and the start of the publish latency metric.';
