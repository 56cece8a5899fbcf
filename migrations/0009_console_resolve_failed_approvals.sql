-- Resolving as failed a process step whose outcome is unknown (the remote may have acted) needs a
-- second person (issue 23): such a request now waits in console_approvals like the other
-- sensitive actions.
ALTER TABLE {{schema}}.console_approvals DROP CONSTRAINT console_approvals_action_check;
ALTER TABLE {{schema}}.console_approvals ADD CONSTRAINT console_approvals_action_check
    CHECK (action IN ('outbox.requeue', 'dlq.replay', 'process.run_compensation', 'process.resolve_succeeded', 'process.resolve_failed'));
COMMENT ON TABLE {{schema}}.console_approvals IS 'Sensitive actions (bulk requeue or replay, compensations, resolving as succeeded, resolving as failed a step whose outcome is unknown) wait here until a second person with the approver role approves or rejects them.';
