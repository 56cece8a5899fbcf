-- Process steps that wait (issue 25, item 3): a step may wait for an external event correlated by
-- a key, with a deadline, or for a time ("continue at T"). A waiting process holds no lease: it is
-- a `waiting` row whose next_run_at is its deadline (or its timer), woken early by
-- processes::signal, which stores the event and makes the process due in the caller's
-- transaction. Events are kept by key in process_events, so one that arrives before its process
-- reaches the wait is found there when it does.

ALTER TABLE {{schema}}.process_steps DROP CONSTRAINT process_steps_execution_check;
ALTER TABLE {{schema}}.process_steps ADD CONSTRAINT process_steps_execution_check
    CHECK (execution IN ('local', 'external', 'operator', 'wait', 'timer'));
ALTER TABLE {{schema}}.process_steps DROP CONSTRAINT process_steps_remote_only_external;
ALTER TABLE {{schema}}.process_steps ADD CONSTRAINT process_steps_remote_only_external
    CHECK ((execution IN ('external', 'wait')) = (remote IS NOT NULL));
ALTER TABLE {{schema}}.process_steps
    ADD COLUMN wait_key   text CHECK (octet_length(wait_key) BETWEEN 1 AND 500),
    ADD COLUMN wait_since timestamptz,
    ADD COLUMN wait_until timestamptz,
    ADD CONSTRAINT process_steps_wait_only_waits CHECK
        (wait_key IS NULL OR execution = 'wait'),
    ADD CONSTRAINT process_steps_wait_has_deadline CHECK
        ((execution IN ('wait', 'timer') AND status NOT IN ('pending')) OR wait_until IS NULL);
COMMENT ON COLUMN {{schema}}.process_steps.execution IS 'local: effect and checkpoint in one transaction; external: a call to a remote system; operator: a person''s decision; wait: waits for an external event (process_events, by wait_key) until wait_until, then queries the remote; timer: continues at wait_until.';
COMMENT ON COLUMN {{schema}}.process_steps.wait_key IS 'For a wait step: the correlation key of the awaited event (e.g. charge:<id>), set when the wait began.';
COMMENT ON COLUMN {{schema}}.process_steps.wait_since IS 'For wait and timer steps: when the wait began.';
COMMENT ON COLUMN {{schema}}.process_steps.wait_until IS 'For a wait step: its deadline (after it the remote is queried, or the step goes to manual review); for a timer: when the process continues.';

-- The wake-up finds the processes waiting for a key.
CREATE INDEX process_steps_wait_key_idx ON {{schema}}.process_steps (wait_key)
    WHERE wait_key IS NOT NULL AND status IN ('running', 'retryable');

CREATE TABLE {{schema}}.process_events (
    key          text        PRIMARY KEY CHECK (octet_length(key) BETWEEN 1 AND 500),
    payload      jsonb       NOT NULL,
    source       text        NOT NULL CHECK (octet_length(source) BETWEEN 1 AND 500),
    received_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {{schema}}.process_events IS 'External events for waiting process steps, by correlation key, written by processes::signal in the caller''s transaction (e.g. the webhook inbox row''s). The first event for a key is kept (later ones are ignored: a wait takes one outcome); it stays as the evidence of the wait it ended, and waits for a process that has not reached its wait yet.';
COMMENT ON COLUMN {{schema}}.process_events.key IS 'Correlation key, as the waiting step names it (e.g. charge:<id>).';
COMMENT ON COLUMN {{schema}}.process_events.payload IS 'What the event says (small; the step interprets it).';
COMMENT ON COLUMN {{schema}}.process_events.source IS 'Where it came from (e.g. webhook:<event id>), for the audit.';
COMMENT ON COLUMN {{schema}}.process_events.received_at IS 'When it was stored.';
