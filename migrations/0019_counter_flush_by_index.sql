-- The counter flush finds its row by the primary key again, and many-row transactions ask less per
-- row. Nothing a producer or the relay sees changes: the same rules, the same numbers.
--
-- 1. aggregate_seq_cache_flush (migration 8) read the counter row it writes with a sequential scan
--    of aggregate_sequences, one scan per flush. Its callers pass TG_TABLE_SCHEMA, of type name,
--    whose collation is "C"; a PL/pgSQL function runs with the collation of its call's arguments, so
--    every text comparison inside, the UPDATE's WHERE included, compared under "C". The primary key
--    is in the database's collation (en_US.UTF-8, C.UTF-8, ...), so the planner could not use it
--    for a "C" comparison. Every transaction that wrote two or more messages of one aggregate (the
--    counter then falls behind and is flushed at commit, or when the transaction moves on to another
--    aggregate) scanned every counter row: measured with 431,137 counters, 27.5 ms per flush, and
--    100-row transactions on one aggregate ran at a sixth of their speed. It grows with the number of
--    aggregates that ever had a message, which is every order, account or customer an installation
--    has. (A database whose default collation is "C" did not have it.) The comparisons now name the
--    column's collation, and sequential scans are off inside the function, as in the insert trigger
--    (migration 18), so a plan made while the counters table was small is not kept for a big one.
--
-- 2. The commit-time flush's WHEN (migration 15) calls aggregate_seq_flush_unqueued for every row
--    while the cache is behind: in a 100-row transaction on one aggregate, 99 calls that answer
--    false because the flush is already queued. The function carried SET search_path: a function
--    with a SET clause saves, sets and restores the setting on every call, and each new search_path
--    is resolved again, the larger part of such a small call. It runs as the
--    caller (not SECURITY DEFINER) and touches no table, so a caller's search_path can only affect
--    the caller; the clause goes. (pgbench, 100-row transactions on one aggregate: 347-350
--    transactions/s with it, 359-365 without.)

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
    ignored text;
BEGIN
    IF left(cache, 1) <> 'd' OR left(rest, schema_end - 1) <> own_schema THEN
        RETURN;
    END IF;
    -- type_len counts bytes: cut by bytes, then take the rest as the id.
    type_text := convert_from(substring(convert_to(type_and_id, 'UTF8') FROM 1 FOR type_len), 'UTF8');
    -- COLLATE "default": the primary key's collation, whatever collation this call runs with.
    UPDATE {{schema}}.aggregate_sequences
    SET last_seq = substr(cache, 2, colon - 2)::bigint
    WHERE aggregate_type = type_text COLLATE "default"
      AND aggregate_id = substr(type_and_id, char_length(type_text) + 1) COLLATE "default";
    ignored := set_config('outbox.aggregate_seq_cache', 'c' || substr(cache, 2), true);
END;
$$;

ALTER FUNCTION {{schema}}.aggregate_seq_flush_unqueued(text) RESET search_path;
