-- Cheaper producer inserts (issue 21: a single-row insert may lose at most 15 % against migration 7).
-- Nothing a producer or the relay sees changes: the same rules, the same numbers.
--
-- 1. The header CHECK functions become PL/pgSQL. As SQL functions with a subquery they cannot be
--    inlined, and PostgreSQL parses and plans a non-inlined SQL function anew for every statement
--    that evaluates it: four functions, four parse-and-plan rounds per INSERT statement, the
--    largest part of a single-row insert's CPU. PL/pgSQL keeps its plans for the session, and an
--    empty or small header object costs a few microseconds.
-- 2. The commit-time flush of the number cache is queued only when the cache is behind ('d'). A row
--    that counted on its own counter row (the usual single-row transaction) leaves the counter
--    current and needs no flush; the WHEN now asks nothing in that case.
-- 3. A row of an aggregate outside the cache increments its counter with one upsert instead of an
--    UPDATE followed, for a new aggregate, by an INSERT.

CREATE OR REPLACE FUNCTION {{schema}}.headers_flat_scalars(h jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    e record;
BEGIN
    IF jsonb_typeof(h) <> 'object' THEN
        RETURN false;
    END IF;
    FOR e IN SELECT value FROM jsonb_each(h) LOOP
        IF jsonb_typeof(e.value) NOT IN ('string', 'number', 'boolean') THEN
            RETURN false;
        END IF;
        IF jsonb_typeof(e.value) = 'number'
           AND abs((e.value #>> '{}')::numeric) > 1.7976931348623157e308 THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION {{schema}}.header_names_fit(h jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    name text;
BEGIN
    IF jsonb_typeof(h) <> 'object' THEN
        RETURN true;
    END IF;
    FOR name IN SELECT jsonb_object_keys(h) LOOP
        IF octet_length(name) NOT BETWEEN 1 AND 255 THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION {{schema}}.header_names_not_reserved(h jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    name text;
BEGIN
    IF jsonb_typeof(h) <> 'object' THEN
        RETURN true;
    END IF;
    FOR name IN SELECT lower(k) FROM jsonb_object_keys(h) AS k LOOP
        IF name IN ('cc', 'bcc', 'aggregate_type', 'aggregate_id', 'aggregate_seq',
                    'aggregate_partition', 'created_at')
           OR name LIKE 'x-%'
           OR name LIKE 'cloudevents\_%'
           OR name LIKE 'cloudevents:%' THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION {{schema}}.headers_fit(h jsonb) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    e record;
    entries int := 0;
    bytes bigint := 0;
BEGIN
    IF jsonb_typeof(h) <> 'object' THEN
        RETURN true;
    END IF;
    FOR e IN SELECT key, value FROM jsonb_each(h) LOOP
        entries := entries + 1;
        bytes := bytes + coalesce(octet_length(e.key) + octet_length(e.value #>> '{}'), 0);
        IF entries > 256 OR bytes > 65536 THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END;
$$;

DO $migration$
BEGIN
EXECUTE format($function$
CREATE OR REPLACE FUNCTION {{schema}}.messages_assign_aggregate_seq() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
    own text := TG_TABLE_SCHEMA || '/';
    key text := own || octet_length(NEW.aggregate_type) || '/' || NEW.aggregate_type || NEW.aggregate_id;
    cache text := coalesce(current_setting('outbox.aggregate_seq_cache', true), '');
    colon int := strpos(cache, ':');
    cached text := substr(cache, colon + 1);
    n bigint;
    ignored text;
BEGIN
    -- A repeated id: refused by the unique index or skipped by ON CONFLICT, so it takes no number.
    SELECT m.aggregate_seq INTO n FROM {{schema}}.messages m WHERE m.id = NEW.id;
    IF FOUND THEN
        NEW.aggregate_seq := n;
        RETURN NEW;
    END IF;
    IF colon > 0 AND cached = key THEN
        n := substr(cache, 2, colon - 2)::bigint + 1;
        ignored := set_config('outbox.aggregate_seq_cache', 'd' || n || ':' || key, true);
    ELSE
        IF left(cache, 1) = 'd' AND left(cached, length(own)) = own THEN
            PERFORM {{schema}}.aggregate_seq_cache_flush(cache, TG_TABLE_SCHEMA);
        END IF;
        INSERT INTO {{schema}}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_seq)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = s.last_seq + 1
        RETURNING s.last_seq INTO n;
        -- Another schema's entry that is behind stays for that schema's flush; ours is current.
        IF NOT (left(cache, 1) = 'd' AND left(cached, length(own)) <> own) THEN
            ignored := set_config('outbox.aggregate_seq_cache', 'c' || n || ':' || key, true);
        END IF;
    END IF;
    NEW.aggregate_seq := n;
    NEW.seq := nextval(%L::regclass);
    RETURN NEW;
END;
$body$
$function$, pg_get_serial_sequence('{{schema}}.messages', 'seq'));
END
$migration$;

-- The WHEN runs after the row's BEFORE trigger: a cache that is current ('c', or another schema's
-- entry) needs no flush from this row; a row that left it behind ('d') queues one, once per
-- transaction and schema (aggregate_seq_flush_unqueued, migration 14). Every change to 'd' is
-- made by such a row, so a transaction that ends behind always has its flush queued.
DROP TRIGGER messages_flush_aggregate_seq ON {{schema}}.messages;
CREATE CONSTRAINT TRIGGER messages_flush_aggregate_seq
    AFTER INSERT ON {{schema}}.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (CASE WHEN left(current_setting('outbox.aggregate_seq_cache', true), 1) = 'd'
                            THEN {{schema}}.aggregate_seq_flush_unqueued('{{schema}}')
                            ELSE false END)
    EXECUTE FUNCTION {{schema}}.messages_flush_aggregate_seq('{{schema}}');
