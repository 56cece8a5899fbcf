-- Weighted fair share (issue 38): one tenant's burst must not starve the others. A definition
-- names the input field that says whose work a process is (`Definition::fair_key`); the start
-- copies it here, and a worker with a fair share (`WorkerConfig::fair_share`) claims the due
-- processes of each key in turn, by weight, instead of strictly oldest first.
--
-- The fair claim walks the distinct keys of due processes with a skip scan (one index probe per
-- key, NULL, a definition that names none, included) and takes each key's oldest due rows.

ALTER TABLE {{schema}}.processes ADD COLUMN fair_key text CHECK (octet_length(fair_key) <= 200);
COMMENT ON COLUMN {{schema}}.processes.fair_key IS 'Whose work the process is (a tenant, a merchant), from the input field its definition names (Definition::fair_key); a worker with a fair share claims the keys in turn by weight. NULL: the definition names none.';

CREATE INDEX processes_fair_due_idx ON {{schema}}.processes (fair_key, next_run_at)
    WHERE status IN ('pending', 'running', 'waiting', 'compensating') AND NOT paused;
COMMENT ON INDEX {{schema}}.processes_fair_due_idx IS 'The fair claim: due processes by key, oldest first within a key (processes::store::claim_fair).';
