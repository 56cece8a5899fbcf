-- Console approvals (issue 23).
--
-- 1. Resolving as failed a process step whose outcome is unknown (the remote may have acted) needs
--    a second person: such a request now waits here like the other sensitive actions.
ALTER TABLE {{schema}}.console_approvals DROP CONSTRAINT console_approvals_action_check;
ALTER TABLE {{schema}}.console_approvals ADD CONSTRAINT console_approvals_action_check
    CHECK (action IN ('outbox.requeue', 'dlq.replay', 'process.run_compensation', 'process.resolve_succeeded', 'process.resolve_failed'));
COMMENT ON TABLE {{schema}}.console_approvals IS 'Sensitive actions (bulk requeue or replay, compensations, resolving as succeeded, resolving as failed a step whose outcome is unknown) wait here until a second person with the approver role approves or rejects them, or the target changes (superseded).';

-- 2. One pending request per (target, action): asking again answers with the first.
ALTER TABLE {{schema}}.console_approvals ADD COLUMN target text;
COMMENT ON COLUMN {{schema}}.console_approvals.target IS 'What the action is on, as the audit log names it (process:<id>, outbox:<ids>, dlq:<consumer>/<ids>); at most one pending request per (action, target). NULL for requests made before this column existed.';
CREATE UNIQUE INDEX console_approvals_one_pending_idx ON {{schema}}.console_approvals (action, target) WHERE status = 'pending';

-- 3. A request on a process whose version moved on is closed as superseded: nobody decided it,
--    and nothing ran.
ALTER TABLE {{schema}}.console_approvals DROP CONSTRAINT console_approvals_status_check;
ALTER TABLE {{schema}}.console_approvals ADD CONSTRAINT console_approvals_status_check
    CHECK (status IN ('pending', 'approved', 'rejected', 'superseded'));
ALTER TABLE {{schema}}.console_approvals DROP CONSTRAINT console_approvals_decided;
ALTER TABLE {{schema}}.console_approvals ADD CONSTRAINT console_approvals_decided CHECK (
    (status = 'pending') = (decided_at IS NULL)
    AND (status IN ('approved', 'rejected')) = (decided_by IS NOT NULL));
COMMENT ON COLUMN {{schema}}.console_approvals.status IS 'pending: waiting; approved: the effect ran in the approving transaction; rejected: nothing ran; superseded: the target changed since the request (its version moved on), nothing ran.';
