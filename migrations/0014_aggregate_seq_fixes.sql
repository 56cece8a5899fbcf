-- Three mends to the per-aggregate numbering of migration 8.
--
-- 1. Two installations written in one transaction lost a counter update. The transaction's cache
--    (outbox.aggregate_seq_cache) holds one aggregate of one schema. A row of schema B replaced a
--    behind ('d') entry of schema A without writing it to A's counter, so A's next transaction was
--    handed numbers A had already used: two messages with one position, and an ordered consumer
--    refuses the second as stale. Now a row that meets another schema's behind entry leaves it in
--    place (A's own commit-time flush writes it) and counts on its own counter row without the cache.
--
-- 2. A row that repeats an existing message id used up a number. The BEFORE trigger runs before the
--    unique index looks: a plain INSERT then fails as a whole (nothing lost), but
--    INSERT ... ON CONFLICT (id) DO NOTHING skipped the row and kept the increment, leaving a gap
--    that ordered consumers wait on until their gap timeout. Now a row whose id is already in the
--    table takes no number: it carries the stored row's number (it is never stored itself: the
--    unique index refuses it or ON CONFLICT skips it). Two transactions inserting one new id at the
--    same moment cannot see each other's row; the later one still uses up a number, as before.
--
-- 3. The commit-time flush was queued once per row: a 100-row transaction queued 100 deferred
--    events for one counter write. It is now queued once per transaction and schema: the trigger's
--    WHEN (evaluated at insert time, not at commit) asks aggregate_seq_flush_unqueued, which marks
--    the schema in outbox.aggregate_seq_flush. The flush clears the mark when it runs, so a flush
--    forced early by SET CONSTRAINTS ... IMMEDIATE is queued again by the next row. A rolled-back
--    savepoint drops both the mark and the event it queued.
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
        UPDATE {{schema}}.aggregate_sequences SET last_seq = last_seq + 1
        WHERE aggregate_type = NEW.aggregate_type AND aggregate_id = NEW.aggregate_id
        RETURNING last_seq INTO n;
        IF NOT FOUND THEN
            INSERT INTO {{schema}}.aggregate_sequences AS s (aggregate_type, aggregate_id, last_seq)
            VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
            ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = s.last_seq + 1
            RETURNING s.last_seq INTO n;
        END IF;
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

-- True the first time it is asked for a schema in a transaction (or since that schema's last
-- flush): the flush trigger's WHEN, so the flush is queued once, not once per row.
CREATE FUNCTION {{schema}}.aggregate_seq_flush_unqueued(own_schema text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    queued text := coalesce(current_setting('outbox.aggregate_seq_flush', true), '');
    mark text := '/' || own_schema || '/';
    ignored text;
BEGIN
    IF strpos(queued, mark) > 0 THEN
        RETURN false;
    END IF;
    ignored := set_config('outbox.aggregate_seq_flush', queued || mark, true);
    RETURN true;
END;
$$;
COMMENT ON FUNCTION {{schema}}.aggregate_seq_flush_unqueued(text) IS 'WHEN of the deferred flush trigger: true once per transaction and schema (until the flush runs), so a many-row transaction queues one flush.';

CREATE OR REPLACE FUNCTION {{schema}}.messages_flush_aggregate_seq() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cache text := coalesce(current_setting('outbox.aggregate_seq_cache', true), '');
    ignored text;
BEGIN
    -- TG_ARGV[0] is the mark the WHEN set (the schema as the migration spelled it).
    ignored := set_config('outbox.aggregate_seq_flush',
        replace(coalesce(current_setting('outbox.aggregate_seq_flush', true), ''), '/' || TG_ARGV[0] || '/', ''), true);
    IF left(cache, 1) = 'd' THEN
        PERFORM {{schema}}.aggregate_seq_cache_flush(cache, TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER messages_flush_aggregate_seq ON {{schema}}.messages;
CREATE CONSTRAINT TRIGGER messages_flush_aggregate_seq
    AFTER INSERT ON {{schema}}.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN ({{schema}}.aggregate_seq_flush_unqueued('{{schema}}'))
    EXECUTE FUNCTION {{schema}}.messages_flush_aggregate_seq('{{schema}}');
