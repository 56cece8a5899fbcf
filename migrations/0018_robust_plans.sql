-- Plans that do not depend on fresh statistics. Two statements that run for every row had plans
-- that were fine while the outbox's statistics matched it and ruinous when they did not; an
-- outbox's statistics are stale exactly when it matters: after a bulk load, a burst, or a relay
-- that was down for a while.
--
-- 1. The relay's claim reads the head of each partition from messages_claim_idx
--    (partition, seq). When the last ANALYZE saw the pending rows in one or a few partitions (one
--    hot aggregate, say), the planner took `partition = $p` to match nearly every row and walked
--    the primary key in seq order instead, filtering for the partition: for each of the 64
--    partitions, through every pending row of the others. Measured: a claim of 2,000 rows took
--    300-470 ms instead of ~5 ms, and the relay drained at half the broker's speed. The partition
--    is a hash of the aggregate over 64 values whatever the traffic, so the planner is told so:
--    n_distinct = 64 makes `partition = $p` one row in 64, and the partition's index wins
--    whatever the sample saw. ANALYZE applies it now instead of at the next autovacuum.
--
-- 2. The insert trigger looks the new row's id up (a repeated id takes no number, migration 14).
--    PL/pgSQL keeps that statement's plan for the session. Planned while the outbox was empty
--    (right after the relay drained it, or a TRUNCATE), it was a sequential scan, and it stayed
--    one while the table grew: a transaction inserting 50,000 rows spent 0.46 ms per row on the
--    lookup, quadratic in the transaction's size. Sequential scans are off inside the trigger
--    function, so the lookup always probes messages_id_idx, also in a session that planned it on
--    an empty table. A later CREATE OR REPLACE of the function must carry the setting again.

ALTER TABLE {{schema}}.messages ALTER COLUMN partition SET (n_distinct = 64);
ANALYZE {{schema}}.messages;

ALTER FUNCTION {{schema}}.messages_assign_aggregate_seq() SET enable_seqscan = off;
