-- Finding processes (issue 23, item 4): the console's one search box and its keyset pages
-- (processes::find). Every search key is an indexed lookup, and a page is a range of an index
-- ordered by id (UUIDv7: creation order), so the first and the thousandth page cost the same.
-- The process id and the operation id already have their unique indexes (primary key,
-- process_steps_operation_unique).

-- Search by business key alone: processes_business_key (migration 16; the unique
-- processes_business_key_revision leads with kind).
-- Search by any top-level value of the displayed input (an order id, a payment id): the GIN index
-- answers `input_redacted @? '$.* ? (@ == "...")'`. Only the redacted input is indexed, so a
-- sensitive value can never be found by guessing it.
CREATE INDEX processes_input_redacted_idx ON {{schema}}.processes USING gin (input_redacted);
-- A status filter's pages: newest first within a status, from the cursor on.
CREATE INDEX processes_status_id_idx ON {{schema}}.processes (status, id);
-- Search by the remote's reference of an effect (a charge id).
CREATE INDEX process_steps_remote_ref_idx ON {{schema}}.process_steps (remote_ref)
    WHERE remote_ref IS NOT NULL;
-- The filters on a process's open step (step name, last error class, remote): open steps are the
-- few of live processes, so this partial index stays small however many processes ended.
CREATE INDEX process_steps_open_idx ON {{schema}}.process_steps (name, error_class)
    WHERE status IN ('running', 'retryable', 'failed', 'manual_review');

-- A process action by filter (issue 23, item 7) waits for a second person as one approval
-- request over the (id, version) pairs the filter selected: processes.<action>.
ALTER TABLE {{schema}}.console_approvals DROP CONSTRAINT console_approvals_action_check;
ALTER TABLE {{schema}}.console_approvals ADD CONSTRAINT console_approvals_action_check
    CHECK (action IN ('outbox.requeue', 'dlq.replay', 'process.run_compensation', 'process.resolve_succeeded',
                      'process.resolve_failed', 'ordered.skip', 'ordered.dead_letter_run',
                      'processes.rerun_step', 'processes.query_remote_status', 'processes.escalate',
                      'processes.pause', 'processes.resume'));
COMMENT ON TABLE {{schema}}.console_approvals IS 'Sensitive actions (bulk requeue or replay, compensations, resolving as succeeded, resolving as failed a step whose outcome is unknown, skipping or dead-lettering an ordered consumer''s held messages, a process action on the processes a filter selected) wait here until a second person with the approver role approves or rejects them, or the target changes (superseded).';
COMMENT ON COLUMN {{schema}}.console_approvals.target IS 'What the action is on, as the audit log names it (process:<id>, outbox:<ids>, dlq:<consumer>/<ids>, ordered:<consumer>/<aggregate_type>/<aggregate_id>, processes?<filter> for a process action by filter); at most one pending request per (action, target). NULL for requests made before this column existed.';
