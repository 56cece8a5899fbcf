-- The relay's claim does not depend on how many rows were published since the oldest snapshot
-- (issue 39). A claim used to read each partition of messages_claim_idx from its start: while a
-- snapshot older than the published rows is held (pg_dump, a report, a replica's
-- hot_standby_feedback, an idle transaction), their index entries cannot be marked dead, and
-- every claim walked them again (1.4 ms per 1,000 rows published since the snapshot began).
--
-- Now the relay remembers, per partition, the position it has passed and reads only past it. A
-- row can commit late below that position (its seq is taken at INSERT, not at commit): it belongs
-- to a transaction that was still running when the relay passed its position. The relay keeps the
-- running transactions of each claim's snapshot and, on the next claims, asks for the pending rows
-- of exactly those transactions (and of every later one) through `txid`, a point lookup each.
--
-- The producer's contract does not change: `txid` has a default (the inserting transaction's id),
-- like every other column a producer leaves out. Rows written before this migration keep NULL:
-- they were committed when it ran (ALTER TABLE waits for the producers' transactions).

ALTER TABLE {{schema}}.messages ADD COLUMN txid xid8;
ALTER TABLE {{schema}}.messages ALTER COLUMN txid SET DEFAULT pg_current_xact_id();
COMMENT ON COLUMN {{schema}}.messages.txid IS 'The inserting transaction (default pg_current_xact_id()): the relay finds a row that committed late, below the position it has passed, by its transaction. Set by the default; NULL for rows written before migration 23.';

CREATE INDEX messages_late_idx ON {{schema}}.messages (txid) WHERE state = 'pending';
COMMENT ON INDEX {{schema}}.messages_late_idx IS 'The claim''s late rows: pending rows of the transactions that were running when the relay passed their position (relay::store::claim).';
