-- A dense position for every message within its aggregate: 1, 2, 3, ... per (aggregate_type,
-- aggregate_id), in commit order, assigned inside the producer's transaction with no call from the
-- producer. The plain-SQL contract does not change: the same INSERT gets its number from a trigger.
--
-- How: one counter row per aggregate. The BEFORE INSERT trigger increments it (an upsert), which
-- takes that row's lock until the producer's transaction ends. A second transaction writing the
-- same aggregate waits for the first, so their commits follow their numbers; a rollback undoes the
-- increment, so no number is lost. Producers on different aggregates touch different counter rows
-- and never wait for each other. The trigger then takes the message's outbox position (seq) too,
-- after the lock: within an aggregate, seq order is then the number's order, which is what the
-- relay's claim (partition heads in seq order) relies on.
CREATE TABLE {{schema}}.aggregate_sequences (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL CHECK (last_seq >= 1),
    PRIMARY KEY (aggregate_type, aggregate_id)
);
COMMENT ON TABLE {{schema}}.aggregate_sequences IS 'The last per-aggregate sequence number handed out, one row per aggregate that ever had a message. Its row lock, held to the producer''s commit, orders the commits of one aggregate. Rows are never deleted: a restarted count would look like old messages to ordered consumers.';
COMMENT ON COLUMN {{schema}}.aggregate_sequences.last_seq IS 'The aggregate_seq of the aggregate''s latest message (committed, or held by the transaction that holds this row''s lock).';

ALTER TABLE {{schema}}.messages ADD COLUMN aggregate_seq bigint;
COMMENT ON COLUMN {{schema}}.messages.aggregate_seq IS 'Position within the aggregate (aggregate_type, aggregate_id): 1, 2, 3, ... dense, in commit order; set by a trigger at INSERT (a value given by the producer is replaced). AMQP header aggregate_seq. Rows present when migration 8 ran were numbered in seq order.';

-- Rows already present (pending, retained or dead) are numbered in outbox order.
UPDATE {{schema}}.messages m SET aggregate_seq = n.rn
FROM (
    SELECT seq, row_number() OVER (PARTITION BY aggregate_type, aggregate_id ORDER BY seq) AS rn
    FROM {{schema}}.messages
) n
WHERE m.seq = n.seq;
INSERT INTO {{schema}}.aggregate_sequences (aggregate_type, aggregate_id, last_seq)
SELECT aggregate_type, aggregate_id, max(aggregate_seq) FROM {{schema}}.messages
GROUP BY aggregate_type, aggregate_id;

ALTER TABLE {{schema}}.messages ALTER COLUMN aggregate_seq SET NOT NULL;

ALTER TABLE {{schema}}.messages ADD CONSTRAINT messages_aggregate_seq_positive CHECK (aggregate_seq >= 1);

-- The counter row is written once per run of consecutive rows of one aggregate in a transaction,
-- not once per row: PostgreSQL keeps every version a transaction writes of a row, and finding the
-- current one gets slower with each, so 20,000 updates of one counter in one transaction took
-- 52 s. The transaction's last aggregate and its number are kept in a transaction-local setting
-- (outbox.aggregate_seq_cache, reverted with the transaction or savepoint that set it):
--   'c' or 'd' (the counter row is current / behind) || number || ':' || schema || '/' ||
--   length(aggregate_type) || '/' || aggregate_type || aggregate_id.
-- A row of the cached aggregate takes the next number from there; a row of another aggregate first
-- brings a 'd' counter up to date, then increments its own counter row (locking it to commit). A
-- deferred trigger brings the last one up to date at commit.
--
-- The functions run as their owner (SECURITY DEFINER, with a fixed search_path and every name
-- schema-qualified): a producer's least-privilege role needs only INSERT on messages (or on the
-- legacy view), not rights on the counters or the identity sequence.
--
-- Written with the identity sequence's name resolved now (tables adopted from the legacy layout keep
-- their old sequence name), so each row pays one nextval and no catalog lookup.
DO $migration$
BEGIN
EXECUTE format($function$
CREATE FUNCTION {{schema}}.messages_assign_aggregate_seq() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
    key text := TG_TABLE_SCHEMA || '/' || octet_length(NEW.aggregate_type) || '/' || NEW.aggregate_type || NEW.aggregate_id;
    cache text := coalesce(current_setting('outbox.aggregate_seq_cache', true), '');
    colon int := strpos(cache, ':');
    n bigint;
    ignored text;
BEGIN
    IF colon > 0 AND substr(cache, colon + 1) = key THEN
        n := substr(cache, 2, colon - 2)::bigint + 1;
        ignored := set_config('outbox.aggregate_seq_cache', 'd' || n || ':' || key, true);
    ELSE
        IF left(cache, 1) = 'd' THEN
            PERFORM {{schema}}.aggregate_seq_cache_flush(cache, TG_TABLE_SCHEMA);
        END IF;
        UPDATE {{schema}}.aggregate_sequences SET last_seq = last_seq + 1
        WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id
        RETURNING last_seq INTO n;
        IF NOT FOUND THEN
            INSERT INTO {{schema}}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_seq)
            VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
            ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = s.last_seq + 1
            RETURNING s.last_seq INTO n;
        END IF;
        ignored := set_config('outbox.aggregate_seq_cache', 'c' || n || ':' || key, true);
    END IF;
    NEW.aggregate_seq := n;
    NEW.seq := nextval(%L::regclass);
    RETURN NEW;
END;
$body$
$function$, pg_get_serial_sequence('{{schema}}.messages', 'seq'));
END
$migration$;
COMMENT ON FUNCTION {{schema}}.messages_assign_aggregate_seq() IS 'BEFORE INSERT row trigger: takes the aggregate''s next number (locking its counter row to commit), then the outbox position, so seq order within an aggregate is commit order.';

-- Brings the cached aggregate's counter row up to the number the cache holds (see above). The caller
-- passes its table's schema: a cache entry of another installation's schema is left to that one.
CREATE FUNCTION {{schema}}.aggregate_seq_cache_flush(cache text, own_schema text) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    colon int := strpos(cache, ':');
    rest text := substr(cache, colon + 1);
    schema_end int := strpos(rest, '/');
    after_schema text := substr(rest, schema_end + 1);
    len_end int := strpos(after_schema, '/');
    type_len int := substr(after_schema, 1, len_end - 1)::int;
    type_and_id text := substr(after_schema, len_end + 1);
    type_text text;
    ignored text;
BEGIN
    IF left(cache, 1) <> 'd' OR left(rest, schema_end - 1) <> own_schema THEN
        RETURN;
    END IF;
    -- type_len counts bytes: cut by bytes, then take the rest as the id.
    type_text := convert_from(substring(convert_to(type_and_id, 'UTF8') FROM 1 FOR type_len), 'UTF8');
    UPDATE {{schema}}.aggregate_sequences
    SET last_seq = substr(cache, 2, colon - 2)::bigint
    WHERE aggregate_type = type_text
      AND aggregate_id = substr(type_and_id, char_length(type_text) + 1);
    ignored := set_config('outbox.aggregate_seq_cache', 'c' || substr(cache, 2), true);
END;
$$;
-- Only the trigger functions (running as the owner) call it: nobody may set a counter through it.
REVOKE EXECUTE ON FUNCTION {{schema}}.aggregate_seq_cache_flush(text, text) FROM PUBLIC;
COMMENT ON FUNCTION {{schema}}.aggregate_seq_cache_flush(text, text) IS 'Writes the number held in the transaction''s aggregate_seq cache to the aggregate''s counter row (see messages_assign_aggregate_seq).';

CREATE FUNCTION {{schema}}.messages_flush_aggregate_seq() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cache text := coalesce(current_setting('outbox.aggregate_seq_cache', true), '');
BEGIN
    IF left(cache, 1) = 'd' THEN
        PERFORM {{schema}}.aggregate_seq_cache_flush(cache, TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END;
$$;
COMMENT ON FUNCTION {{schema}}.messages_flush_aggregate_seq() IS 'Deferred row trigger (fires at commit): writes the transaction''s last cached aggregate number to its counter row.';

CREATE TRIGGER messages_assign_aggregate_seq
    BEFORE INSERT ON {{schema}}.messages
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.messages_assign_aggregate_seq();
CREATE CONSTRAINT TRIGGER messages_flush_aggregate_seq
    AFTER INSERT ON {{schema}}.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.messages_flush_aggregate_seq();

-- aggregate_seq is set by the relay, and CloudEvents attributes (cloudEvents_* in the AMQP binding,
-- cloudEvents:* in the AMQP 1.0 form) are the relay's to set when an exchange publishes CloudEvents.
CREATE OR REPLACE FUNCTION {{schema}}.header_names_not_reserved(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN jsonb_typeof(h) <> 'object' THEN true ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_object_keys(h) AS k(name)
        WHERE lower(k.name) IN ('cc', 'bcc', 'aggregate_type', 'aggregate_id', 'aggregate_seq', 'created_at')
           OR lower(k.name) LIKE 'x-%'
           OR lower(k.name) LIKE 'cloudevents\_%'
           OR lower(k.name) LIKE 'cloudevents:%'
    ) END
$$;
-- A pending row that already uses one of the newly reserved names could not be published as it is
-- (and would break its CHECK on its next update): it goes dead with the reason, to be fixed and
-- requeued (relay dead requeue) like any other row refused at the door.
UPDATE {{schema}}.messages
SET state = 'dead', last_error = 'unpublishable: header names aggregate_seq, cloudEvents_* and cloudEvents:* are reserved since migration 8', last_attempt_at = now()
WHERE state = 'pending' AND NOT {{schema}}.header_names_not_reserved(headers);

COMMENT ON FUNCTION {{schema}}.header_names_not_reserved(jsonb) IS 'True when no header name is reserved: CC and BCC (RabbitMQ routes copies by them), x-* (RabbitMQ, its plugins and the consumer runtime give them meaning), cloudEvents_* and cloudEvents:* (CloudEvents attributes the relay sets), and the headers the relay sets itself. Compared without regard to case.';

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
        WHEN NOT {{schema}}.header_names_not_reserved(headers) THEN 'header names CC, BCC, x-*, cloudEvents_*, cloudEvents:*, aggregate_type, aggregate_id, aggregate_seq and created_at are reserved'
        WHEN NOT {{schema}}.headers_fit(headers) THEN 'headers must have at most 256 entries and 64 KiB of names and values'
    END
$$;
