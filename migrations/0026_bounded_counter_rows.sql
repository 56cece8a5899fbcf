-- The producers' insert rate holds up while an old snapshot is held (issue 39, item 3). Each
-- transaction moves its aggregates' counter rows on with an update. While a snapshot older than
-- those updates is held (pg_dump, a report, a replica's hot_standby_feedback, an idle
-- transaction), no old version can be pruned, so every counter row's version chain grew by one
-- per transaction, without bound, and every next transaction walked all of it: four producers fell
-- from 8,965 to 6,295 msg/s within 60 s of a held snapshot, and aggregate_sequences grew from 8.7
-- to 38.3 MB with 561,639 dead versions.
--
-- Now a counter row takes at most 32 updates (`updates`). The transaction that finds its
-- aggregate's row full closes it (`closed`, under the row's lock, as any update) and goes on in a
-- new row, numbered on from it (`first_seq` = the closed row's last_seq + 1). Everyone finds the
-- aggregate's current row at the top of the primary key (aggregate_type, aggregate_id, first_seq):
-- one index entry, however many closed rows and versions older snapshots keep below it. So a chain
-- holds at most 32 versions and a lookup walks at most that, whatever the horizon. (A unique index
-- over open rows alone would not do: the entries of closed rows stay in it under an old snapshot,
-- and each leads to its row's whole chain.) Without an old snapshot, HOT pruning keeps chains short
-- as before, and closing costs one row insert per 32 transactions of an aggregate.
--
-- An aggregate's first row has first_seq 1 and is never deleted, so the usual case stays the one
-- upsert it was, on the key (type, id, 1): a new aggregate's first row, or the next number on it
-- while it has room. Most aggregates (an order, a payment) never need a second row. One with more
-- than 33 numbers finds its first row closed (the upsert locks it and changes nothing) and updates
-- its current row, found at the top: two statements instead of one, measured in
-- docs/operations.md.
--
-- Every number still comes from the latest version of a locked row, as before: an update waits
-- for the row's holder and rechecks that the row is neither closed nor full; a transaction that
-- meets a closed row (its successor not yet visible, or the row deleted by the purge) reads the top
-- again. A new aggregate's first row is inserted with ON CONFLICT DO NOTHING and read again when
-- another transaction inserted it first. Under REPEATABLE READ or SERIALIZABLE a row changed or
-- deleted since the snapshot is a serialization failure (40001), as the update was before.
--
-- Closed rows are deleted by the relay's counter purge (relay::counters), found through a partial
-- index; the current row is never deleted. An aggregate's first row (first_seq 1) is kept too: a
-- new aggregate's row is inserted with that key, so the kept row is what makes the insert conflict
-- for an aggregate that exists, also for a REPEATABLE READ transaction whose snapshot predates it
-- (a serialization failure then, instead of number 1 again). Locking a closed first row writes no
-- version.
--
-- Rows from before this migration cover their aggregates' numbers from 1 (first_seq = 1, stored
-- defaults, no table rewrite). The transaction-local cache of migrations 8 and 14 is unchanged:
-- the rows after the first of a run take their numbers from it, and its flush writes the run's
-- last number to the row the transaction holds.

-- Producers wait at their INSERT into messages while this runs, before their trigger starts: a
-- trigger that started with the old function and then waited here for the counters would plan the
-- old upsert against the new primary key and fail (42P10). Reads of the outbox go on.
LOCK TABLE {{schema}}.messages IN SHARE ROW EXCLUSIVE MODE;
LOCK TABLE {{schema}}.aggregate_sequences IN ACCESS EXCLUSIVE MODE;

ALTER TABLE {{schema}}.aggregate_sequences ADD COLUMN first_seq bigint NOT NULL DEFAULT 1;
ALTER TABLE {{schema}}.aggregate_sequences ALTER COLUMN first_seq DROP DEFAULT;
ALTER TABLE {{schema}}.aggregate_sequences ADD COLUMN updates integer NOT NULL DEFAULT 0;
ALTER TABLE {{schema}}.aggregate_sequences ADD COLUMN closed boolean NOT NULL DEFAULT false;
ALTER TABLE {{schema}}.aggregate_sequences
    ADD CONSTRAINT aggregate_sequences_row_in_order CHECK (first_seq >= 1 AND first_seq <= last_seq AND updates >= 0);
ALTER TABLE {{schema}}.aggregate_sequences DROP CONSTRAINT aggregate_sequences_pkey;
ALTER TABLE {{schema}}.aggregate_sequences
    ADD CONSTRAINT aggregate_sequences_pkey PRIMARY KEY (aggregate_type, aggregate_id, first_seq);
CREATE INDEX aggregate_sequences_closed_idx ON {{schema}}.aggregate_sequences (aggregate_type, aggregate_id, first_seq)
    WHERE closed AND first_seq > 1;

COMMENT ON TABLE {{schema}}.aggregate_sequences IS 'Per aggregate, the numbers handed out: its current row (the greatest first_seq) holds the latest number in last_seq, and its row lock, held to the producer''s commit, orders the commits of one aggregate. A row takes at most 32 updates, then is closed and followed by a new row, so no version chain grows without bound under an old snapshot. Closed rows (but an aggregate''s first) are deleted by the relay''s counter purge; the current row never is (a restarted count would look like old messages to ordered consumers).';
COMMENT ON COLUMN {{schema}}.aggregate_sequences.first_seq IS 'The first number this row handed out: its key within the aggregate (1 for an aggregate''s first row, and for the rows from before migration 26).';
COMMENT ON COLUMN {{schema}}.aggregate_sequences.last_seq IS 'The aggregate''s latest number while this row is current (committed, or held by the transaction that holds the row''s lock).';
COMMENT ON COLUMN {{schema}}.aggregate_sequences.updates IS 'Updates this row has taken; at 32 the next transaction closes it and opens the next row.';
COMMENT ON COLUMN {{schema}}.aggregate_sequences.closed IS 'A later row continues the count; nothing updates this row again, and the purge deletes it (unless it is the aggregate''s first row).';
COMMENT ON INDEX {{schema}}.aggregate_sequences_closed_idx IS 'The counter purge''s rows (relay::counters).';

-- The aggregate's next number when its current row is not there, full or closed (the trigger tries
-- the usual case itself): a new aggregate's first row, or the close of a full row and the next.
CREATE OR REPLACE FUNCTION {{schema}}.aggregate_seq_next(agg_type text, agg_id text) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS $$
DECLARE
    n bigint;
    top bigint;
BEGIN
    LOOP
        SELECT t.first_seq INTO top FROM {{schema}}.aggregate_sequences t
        WHERE t.aggregate_type = agg_type COLLATE "default" AND t.aggregate_id = agg_id COLLATE "default"
        ORDER BY t.first_seq DESC LIMIT 1;
        IF NOT FOUND THEN
            -- A new aggregate; another transaction may insert its first row at the same moment.
            INSERT INTO {{schema}}.aggregate_sequences (aggregate_type, aggregate_id, first_seq, last_seq)
            VALUES (agg_type, agg_id, 1, 1)
            ON CONFLICT (aggregate_type, aggregate_id, first_seq) DO NOTHING
            RETURNING last_seq INTO n;
            IF FOUND THEN
                RETURN n;
            END IF;
        ELSE
            UPDATE {{schema}}.aggregate_sequences s SET last_seq = s.last_seq + 1, updates = s.updates + 1
            WHERE s.aggregate_type = agg_type COLLATE "default" AND s.aggregate_id = agg_id COLLATE "default"
              AND s.first_seq = top AND NOT s.closed AND s.updates < 32
            RETURNING s.last_seq INTO n;
            IF FOUND THEN
                RETURN n;
            END IF;
            -- Full: close it (under its lock; closed already, or deleted, then read the top again)
            -- and go on in a new row.
            UPDATE {{schema}}.aggregate_sequences s SET closed = true
            WHERE s.aggregate_type = agg_type COLLATE "default" AND s.aggregate_id = agg_id COLLATE "default"
              AND s.first_seq = top AND NOT s.closed
            RETURNING s.last_seq + 1 INTO n;
            IF FOUND THEN
                INSERT INTO {{schema}}.aggregate_sequences (aggregate_type, aggregate_id, first_seq, last_seq)
                VALUES (agg_type, agg_id, n, n);
                RETURN n;
            END IF;
        END IF;
    END LOOP;
END;
$$;
REVOKE EXECUTE ON FUNCTION {{schema}}.aggregate_seq_next(text, text) FROM PUBLIC;
COMMENT ON FUNCTION {{schema}}.aggregate_seq_next(text, text) IS 'The aggregate''s next number when its current counter row is missing, full or closed: the first row, or the close of a full row and the next (migration 26). The row is locked to commit.';

DO $migration$
BEGIN
EXECUTE format($function$
CREATE OR REPLACE FUNCTION {{schema}}.messages_assign_aggregate_seq() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS $body$
DECLARE
    own text := TG_TABLE_SCHEMA || '/';
    key text := own || octet_length(NEW.aggregate_type) || '/' || NEW.aggregate_type || NEW.aggregate_id;
    cache text := coalesce(current_setting('outbox.aggregate_seq_cache', true), '');
    colon int := strpos(cache, ':');
    cached text := substr(cache, colon + 1);
    n bigint;
    ignored text;
BEGIN
    -- A repeated id is refused by the unique index or skipped by ON CONFLICT: it takes no number
    -- and carries the stored row's.
    IF colon > 0 AND cached = key THEN
        SELECT m.aggregate_seq INTO n FROM {{schema}}.messages m WHERE m.id = NEW.id;
        IF FOUND THEN
            NEW.aggregate_seq := n;
            RETURN NEW;
        END IF;
        n := substr(cache, 2, colon - 2)::bigint + 1;
        ignored := set_config('outbox.aggregate_seq_cache', 'd' || n || ':' || key, true);
    ELSE
        IF left(cache, 1) = 'd' AND left(cached, length(own)) = own THEN
            PERFORM {{schema}}.aggregate_seq_cache_flush(cache, TG_TABLE_SCHEMA);
        END IF;
        -- The usual case, one statement as before: a new aggregate's first row, or the next number
        -- on it while it is open and has room (most aggregates never have another row). A closed or
        -- full first row is locked and left as it is.
        INSERT INTO {{schema}}.aggregate_sequences AS s (aggregate_type, aggregate_id, first_seq, last_seq)
        SELECT NEW.aggregate_type, NEW.aggregate_id, 1, 1
        WHERE NOT EXISTS (SELECT FROM {{schema}}.messages m WHERE m.id = NEW.id)
        ON CONFLICT (aggregate_type, aggregate_id, first_seq)
        DO UPDATE SET last_seq = s.last_seq + 1, updates = s.updates + 1
        WHERE NOT s.closed AND s.updates < 32
        RETURNING s.last_seq INTO n;
        IF NOT FOUND THEN
            -- An aggregate with later rows: its current row, at the top of the primary key.
            UPDATE {{schema}}.aggregate_sequences s SET last_seq = s.last_seq + 1, updates = s.updates + 1
            WHERE s.aggregate_type = NEW.aggregate_type AND s.aggregate_id = NEW.aggregate_id
              AND s.first_seq = (SELECT t.first_seq FROM {{schema}}.aggregate_sequences t
                                 WHERE t.aggregate_type = NEW.aggregate_type
                                   AND t.aggregate_id = NEW.aggregate_id
                                 ORDER BY t.first_seq DESC LIMIT 1)
              AND s.first_seq > 1 AND NOT s.closed AND s.updates < 32
              AND NOT EXISTS (SELECT FROM {{schema}}.messages m WHERE m.id = NEW.id)
            RETURNING s.last_seq INTO n;
        END IF;
        IF NOT FOUND THEN
            SELECT m.aggregate_seq INTO n FROM {{schema}}.messages m WHERE m.id = NEW.id;
            IF FOUND THEN
                NEW.aggregate_seq := n;
                RETURN NEW;
            END IF;
            n := {{schema}}.aggregate_seq_next(NEW.aggregate_type, NEW.aggregate_id);
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

-- The flush writes the run's last number to the row this transaction holds: the aggregate's top as
-- this transaction sees it (nobody can close it or go past it before this transaction ends). It
-- counts as one of the row's updates.
CREATE OR REPLACE FUNCTION {{schema}}.aggregate_seq_cache_flush(cache text, own_schema text) RETURNS void LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET enable_seqscan = off AS $$
DECLARE
    colon int := strpos(cache, ':');
    rest text := substr(cache, colon + 1);
    schema_end int := strpos(rest, '/');
    after_schema text := substr(rest, schema_end + 1);
    len_end int := strpos(after_schema, '/');
    type_len int := substr(after_schema, 1, len_end - 1)::int;
    type_and_id text := substr(after_schema, len_end + 1);
    type_text text;
    id_text text;
    ignored text;
BEGIN
    IF left(cache, 1) <> 'd' OR left(rest, schema_end - 1) <> own_schema THEN
        RETURN;
    END IF;
    -- type_len counts bytes: cut by bytes, then take the rest as the id.
    type_text := convert_from(substring(convert_to(type_and_id, 'UTF8') FROM 1 FOR type_len), 'UTF8');
    id_text := substr(type_and_id, char_length(type_text) + 1);
    -- COLLATE "default": the primary key's collation, whatever collation this call runs with
    -- (migration 19).
    UPDATE {{schema}}.aggregate_sequences
    SET last_seq = substr(cache, 2, colon - 2)::bigint, updates = updates + 1
    WHERE aggregate_type = type_text COLLATE "default"
      AND aggregate_id = id_text COLLATE "default"
      AND first_seq = (SELECT s.first_seq FROM {{schema}}.aggregate_sequences s
                       WHERE s.aggregate_type = type_text COLLATE "default"
                         AND s.aggregate_id = id_text COLLATE "default"
                       ORDER BY s.first_seq DESC LIMIT 1);
    ignored := set_config('outbox.aggregate_seq_cache', 'c' || substr(cache, 2), true);
END;
$$;
