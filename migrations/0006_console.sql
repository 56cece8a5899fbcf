-- The operations console (the `console` crate): identities, web sessions, approval requests, the
-- idempotency records of console actions and the append-only audit log, in the product's schema.

CREATE TABLE {{schema}}.console_users (
    id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    name       text        NOT NULL CHECK (octet_length(name) BETWEEN 1 AND 200),
    role       text        NOT NULL CHECK (role IN ('viewer', 'operator', 'approver', 'admin')),
    token_hash bytea       NOT NULL UNIQUE CHECK (octet_length(token_hash) = 32),
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
COMMENT ON TABLE {{schema}}.console_users IS 'People (and scripts) who use the console: one role each, one bearer token each, stored hashed.';
COMMENT ON COLUMN {{schema}}.console_users.id IS 'User id, recorded in the audit log.';
COMMENT ON COLUMN {{schema}}.console_users.name IS 'Display name, unique among users that are not revoked.';
COMMENT ON COLUMN {{schema}}.console_users.role IS 'viewer < operator < approver < admin; each role may do what the roles before it may (see docs/console.md).';
COMMENT ON COLUMN {{schema}}.console_users.token_hash IS 'SHA-256 of the bearer token (256 random bits); the token itself is shown once by console user create and never stored.';
COMMENT ON COLUMN {{schema}}.console_users.created_at IS 'Creation time.';
COMMENT ON COLUMN {{schema}}.console_users.revoked_at IS 'Set by console user revoke: the token and every session of the user stop working.';
CREATE UNIQUE INDEX console_users_active_name_idx ON {{schema}}.console_users (name) WHERE revoked_at IS NULL;

CREATE TABLE {{schema}}.console_sessions (
    token_hash bytea       PRIMARY KEY CHECK (octet_length(token_hash) = 32),
    user_id    uuid        NOT NULL REFERENCES {{schema}}.console_users (id),
    csrf_token text        NOT NULL CHECK (octet_length(csrf_token) = 64),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    CONSTRAINT console_sessions_expire_after_creation CHECK (expires_at > created_at)
);
COMMENT ON TABLE {{schema}}.console_sessions IS 'Web sessions created by logging in with a token; the cookie carries a random session id, stored here hashed.';
COMMENT ON COLUMN {{schema}}.console_sessions.token_hash IS 'SHA-256 of the session cookie value.';
COMMENT ON COLUMN {{schema}}.console_sessions.user_id IS 'Who logged in.';
COMMENT ON COLUMN {{schema}}.console_sessions.csrf_token IS 'Random token every form POST of the session must carry (hidden field csrf).';
COMMENT ON COLUMN {{schema}}.console_sessions.created_at IS 'Login time.';
COMMENT ON COLUMN {{schema}}.console_sessions.expires_at IS 'After this the session leads back to the login page; expired rows are deleted at the next login.';
CREATE INDEX console_sessions_expires_idx ON {{schema}}.console_sessions (expires_at);

CREATE TABLE {{schema}}.console_approvals (
    id              uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    action          text        NOT NULL CHECK (action IN ('outbox.requeue', 'dlq.replay', 'process.run_compensation', 'process.resolve_succeeded')),
    request         jsonb       NOT NULL,
    reason          text        NOT NULL CHECK (reason <> ''),
    requested_by    uuid        NOT NULL REFERENCES {{schema}}.console_users (id),
    requested_at    timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'approved', 'rejected')),
    version         integer     NOT NULL DEFAULT 1 CHECK (version >= 1),
    decided_by      uuid        REFERENCES {{schema}}.console_users (id),
    decided_at      timestamptz,
    decision_reason text,
    result          jsonb,
    CONSTRAINT console_approvals_decided CHECK ((status = 'pending') = (decided_by IS NULL AND decided_at IS NULL)),
    CONSTRAINT console_approvals_four_eyes CHECK (decided_by IS NULL OR decided_by <> requested_by)
);
COMMENT ON TABLE {{schema}}.console_approvals IS 'Sensitive actions (bulk requeue or replay, compensations, resolving as succeeded) wait here until a second person with the approver role approves or rejects them.';
COMMENT ON COLUMN {{schema}}.console_approvals.id IS 'Approval request id.';
COMMENT ON COLUMN {{schema}}.console_approvals.action IS 'The action that runs on approval.';
COMMENT ON COLUMN {{schema}}.console_approvals.request IS 'What exactly runs: the explicit list of targets with the row versions the requester saw, and the action''s parameters.';
COMMENT ON COLUMN {{schema}}.console_approvals.reason IS 'The requester''s reason.';
COMMENT ON COLUMN {{schema}}.console_approvals.requested_by IS 'Who asked; may not decide.';
COMMENT ON COLUMN {{schema}}.console_approvals.requested_at IS 'When.';
COMMENT ON COLUMN {{schema}}.console_approvals.status IS 'pending: waiting; approved: the effect ran in the approving transaction; rejected: nothing ran.';
COMMENT ON COLUMN {{schema}}.console_approvals.version IS 'Row version: 1 while pending, 2 once decided; a decision sends the version it saw.';
COMMENT ON COLUMN {{schema}}.console_approvals.decided_by IS 'The approver (never the requester: four eyes, enforced by a CHECK).';
COMMENT ON COLUMN {{schema}}.console_approvals.decided_at IS 'Decision time.';
COMMENT ON COLUMN {{schema}}.console_approvals.decision_reason IS 'The approver''s reason.';
COMMENT ON COLUMN {{schema}}.console_approvals.result IS 'What the effect did (per target), set when approved.';
CREATE INDEX console_approvals_pending_idx ON {{schema}}.console_approvals (requested_at) WHERE status = 'pending';

CREATE TABLE {{schema}}.console_audit (
    seq         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor_id    uuid,
    actor_name  text        NOT NULL,
    roles       text[]      NOT NULL,
    action      text        NOT NULL CHECK (action <> ''),
    target      text        NOT NULL,
    reason      text        NOT NULL,
    approval_id uuid,
    approver    text,
    before      jsonb,
    after       jsonb,
    outcome     text        NOT NULL CHECK (outcome IN ('succeeded', 'requested', 'approved', 'rejected', 'denied', 'conflict', 'failed'))
);
COMMENT ON TABLE {{schema}}.console_audit IS 'Append-only record of every console action and every denied attempt, written in the action''s own transaction. UPDATE, TRUNCATE and DELETE are refused by triggers; only purge_console_audit() removes rows, and only those older than the retention.';
COMMENT ON COLUMN {{schema}}.console_audit.seq IS 'Order of entries.';
COMMENT ON COLUMN {{schema}}.console_audit.at IS 'When (clock_timestamp).';
COMMENT ON COLUMN {{schema}}.console_audit.actor_id IS 'The user who acted (NULL only for a user since deleted from outside the console).';
COMMENT ON COLUMN {{schema}}.console_audit.actor_name IS 'The user''s name at the time.';
COMMENT ON COLUMN {{schema}}.console_audit.roles IS 'The roles the user had at the time.';
COMMENT ON COLUMN {{schema}}.console_audit.action IS 'Action name (outbox.requeue, dlq.replay, approval.approve, process.escalate, ...).';
COMMENT ON COLUMN {{schema}}.console_audit.target IS 'What it was applied to (outbox:<id>, dlq:<consumer>/<message id>, approval:<id>, process:<id>).';
COMMENT ON COLUMN {{schema}}.console_audit.reason IS 'The reason the actor gave (redacted).';
COMMENT ON COLUMN {{schema}}.console_audit.approval_id IS 'The approval request this entry belongs to, if any.';
COMMENT ON COLUMN {{schema}}.console_audit.approver IS 'Name of the approver, for effects that ran on approval.';
COMMENT ON COLUMN {{schema}}.console_audit.before IS 'The target before the action (redacted).';
COMMENT ON COLUMN {{schema}}.console_audit.after IS 'The target after the action (redacted).';
COMMENT ON COLUMN {{schema}}.console_audit.outcome IS 'succeeded, requested (waits for approval), approved, rejected, denied (403), conflict (stale version, 409), failed.';
CREATE INDEX console_audit_at_idx ON {{schema}}.console_audit (at);
-- A process page lists the entries of its process.
CREATE INDEX console_audit_target_idx ON {{schema}}.console_audit (target, seq);
CREATE INDEX console_audit_approval_idx ON {{schema}}.console_audit (approval_id) WHERE approval_id IS NOT NULL;

CREATE FUNCTION {{schema}}.console_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    cutoff timestamptz := nullif(current_setting('outbox_console.audit_purge_before', true), '')::timestamptz;
BEGIN
    IF TG_OP = 'DELETE' AND cutoff IS NOT NULL THEN
        IF OLD.at < cutoff THEN
            RETURN OLD;
        END IF;
    END IF;
    RAISE EXCEPTION 'the console audit log is append-only: % refused (rows go only through purge_console_audit)', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
COMMENT ON FUNCTION {{schema}}.console_audit_append_only() IS 'Trigger function: refuses UPDATE, TRUNCATE and DELETE on console_audit, except a DELETE of rows older than the cutoff that purge_console_audit sets for its own transaction.';

CREATE TRIGGER console_audit_no_update_delete
    BEFORE UPDATE OR DELETE ON {{schema}}.console_audit
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.console_audit_append_only();
CREATE TRIGGER console_audit_no_truncate
    BEFORE TRUNCATE ON {{schema}}.console_audit
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.console_audit_append_only();

CREATE FUNCTION {{schema}}.purge_console_audit(retention interval) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    removed bigint;
BEGIN
    IF retention < interval '1 day' THEN
        RAISE EXCEPTION 'audit retention must be at least one day, got %', retention;
    END IF;
    PERFORM set_config('outbox_console.audit_purge_before', (now() - retention)::text, true);
    DELETE FROM {{schema}}.console_audit WHERE at < now() - retention;
    GET DIAGNOSTICS removed = ROW_COUNT;
    PERFORM set_config('outbox_console.audit_purge_before', '', true);
    RETURN removed;
END;
$$;
COMMENT ON FUNCTION {{schema}}.purge_console_audit(interval) IS 'The only way audit rows go: deletes entries older than retention (at least one day; the console uses one year by default). Grant EXECUTE on it, and no DELETE on the table, to the role that purges.';
