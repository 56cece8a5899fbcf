-- The console's actions on ordered consumers' stuck aggregates: a skip or a dead-lettered run
-- discards effects, so it waits for a second person like the other sensitive actions.
ALTER TABLE {{schema}}.console_approvals DROP CONSTRAINT console_approvals_action_check;
ALTER TABLE {{schema}}.console_approvals ADD CONSTRAINT console_approvals_action_check
    CHECK (action IN ('outbox.requeue', 'dlq.replay', 'process.run_compensation', 'process.resolve_succeeded',
                      'process.resolve_failed', 'ordered.skip', 'ordered.dead_letter_run'));
COMMENT ON TABLE {{schema}}.console_approvals IS 'Sensitive actions (bulk requeue or replay, compensations, resolving as succeeded, resolving as failed a step whose outcome is unknown, skipping or dead-lettering an ordered consumer''s held messages) wait here until a second person with the approver role approves or rejects them, or the target changes (superseded).';
COMMENT ON COLUMN {{schema}}.console_approvals.target IS 'What the action is on, as the audit log names it (process:<id>, outbox:<ids>, dlq:<consumer>/<ids>, ordered:<consumer>/<aggregate_type>/<aggregate_id>); at most one pending request per (action, target). NULL for requests made before this column existed.';
COMMENT ON COLUMN {{schema}}.console_approvals.status IS 'pending: waiting; approved: the effect ran in the approving transaction; rejected: nothing ran; superseded: the target changed since the request (a process''s version, an aggregate''s applied position moved on), nothing ran.';
