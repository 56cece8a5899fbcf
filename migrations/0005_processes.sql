-- Recoverable multi-step processes (the `processes` crate): one row per process, one per step
-- (forward steps, compensations and operator resolutions linked to the step they act on), an
-- append-only history of every transition with its reason, and the table of allowed transitions
-- that the triggers enforce. Workers claim due processes with FOR UPDATE SKIP LOCKED and a lease
-- whose fencing token comes from process_lease_tokens and increases on every claim.

CREATE SEQUENCE {{schema}}.process_lease_tokens AS bigint;
COMMENT ON SEQUENCE {{schema}}.process_lease_tokens IS 'Fencing tokens: every claim of a process takes the next value, so a later owner always holds a larger token than every earlier one.';

CREATE TABLE {{schema}}.processes (
    id                  uuid        PRIMARY KEY,
    kind                text        NOT NULL CHECK (octet_length(kind) BETWEEN 1 AND 200),
    definition_version  integer     NOT NULL CHECK (definition_version > 0),
    business_key        text        NOT NULL CHECK (octet_length(business_key) BETWEEN 1 AND 500),
    revision            integer     NOT NULL DEFAULT 0 CHECK (revision >= 0),
    revision_of         uuid        REFERENCES {{schema}}.processes (id),
    status              text        NOT NULL DEFAULT 'pending' CHECK (status IN
                            ('pending', 'running', 'waiting', 'succeeded', 'failed', 'compensating',
                             'compensated', 'manual_review', 'cancelled')),
    paused              boolean     NOT NULL DEFAULT false,
    attempt             integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    last_reason         text        NOT NULL CHECK (octet_length(last_reason) BETWEEN 1 AND 1000),
    last_actor          text        NOT NULL DEFAULT 'system' CHECK (octet_length(last_actor) BETWEEN 1 AND 200),
    input               jsonb       NOT NULL,
    input_redacted      jsonb       NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz,
    deadline_at         timestamptz,
    next_run_at         timestamptz NOT NULL DEFAULT now(),
    lease_owner         text,
    lease_until         timestamptz,
    lease_token         bigint      NOT NULL DEFAULT 0,
    row_version         bigint      NOT NULL DEFAULT 1,
    CONSTRAINT processes_business_key_revision UNIQUE (kind, business_key, revision),
    CONSTRAINT processes_revision_linked CHECK ((revision = 0) = (revision_of IS NULL)),
    CONSTRAINT processes_finished_iff_terminal CHECK
        ((status IN ('succeeded', 'failed', 'compensated', 'cancelled')) = (finished_at IS NOT NULL)),
    CONSTRAINT processes_lease_pair CHECK ((lease_owner IS NULL) = (lease_until IS NULL)),
    CONSTRAINT processes_lease_only_when_worked CHECK (lease_owner IS NULL OR status IN ('running', 'compensating'))
);
COMMENT ON TABLE {{schema}}.processes IS 'One row per process (an instance of a definition kind/version started for a business key); its steps are in process_steps, its transitions in process_history.';
COMMENT ON COLUMN {{schema}}.processes.id IS 'Stable process id (UUIDv7), also the prefix of every step''s operation id.';
COMMENT ON COLUMN {{schema}}.processes.kind IS 'Definition kind (e.g. payment); with definition_version it names the Rust definition that drives the process.';
COMMENT ON COLUMN {{schema}}.processes.definition_version IS 'Definition version the process was started with and keeps for life; a worker without this version leaves the process alone.';
COMMENT ON COLUMN {{schema}}.processes.business_key IS 'Caller''s key (an order id, a message id): a second start with the same kind and key returns the existing process.';
COMMENT ON COLUMN {{schema}}.processes.revision IS '0 for an original process; n for the n-th revision (a new process with changed input).';
COMMENT ON COLUMN {{schema}}.processes.revision_of IS 'The process this one revises (changed input is a new process, never an edit in place); NULL for an original.';
COMMENT ON COLUMN {{schema}}.processes.status IS 'pending: not started; running: a worker holds it or may take it; waiting: backing off until next_run_at; succeeded; failed; compensating: undoing earlier effects; compensated; manual_review: a person must decide; cancelled.';
COMMENT ON COLUMN {{schema}}.processes.paused IS 'Set by an operator: workers do not claim a paused process.';
COMMENT ON COLUMN {{schema}}.processes.attempt IS 'Number of claims so far (each claim is one run of the process by a worker).';
COMMENT ON COLUMN {{schema}}.processes.last_reason IS 'Why the last transition happened (recorded in process_history as well).';
COMMENT ON COLUMN {{schema}}.processes.last_actor IS 'Who made the last transition: system (a worker) or an operator''s name.';
COMMENT ON COLUMN {{schema}}.processes.input IS 'Input needed to resume the process, as given to start (readable only by workers; the console shows input_redacted).';
COMMENT ON COLUMN {{schema}}.processes.input_redacted IS 'The input with the fields the definition declares sensitive replaced by "[redacted]", for display.';
COMMENT ON COLUMN {{schema}}.processes.created_at IS 'When the process was started (the start transaction''s time).';
COMMENT ON COLUMN {{schema}}.processes.updated_at IS 'Last change of the row.';
COMMENT ON COLUMN {{schema}}.processes.finished_at IS 'When the process reached a terminal status (succeeded, failed, compensated, cancelled); NULL otherwise.';
COMMENT ON COLUMN {{schema}}.processes.deadline_at IS 'Overall deadline from the definition: past it, forward work stops (failed or manual_review if an outcome is unknown); NULL for none.';
COMMENT ON COLUMN {{schema}}.processes.next_run_at IS 'Earliest time a worker may claim the process: now for new work, the backoff end while waiting, the lease end while held.';
COMMENT ON COLUMN {{schema}}.processes.lease_owner IS 'Worker holding the lease; NULL when released.';
COMMENT ON COLUMN {{schema}}.processes.lease_until IS 'End of the lease; after it another worker may take the process over. Extended by heartbeats.';
COMMENT ON COLUMN {{schema}}.processes.lease_token IS 'Fencing token of the latest claim (from process_lease_tokens); every write of a worker checks it, so a worker that lost its lease can never checkpoint.';
COMMENT ON COLUMN {{schema}}.processes.row_version IS 'Incremented on every status, pause or reason change; operator actions must name the version they saw.';

-- The claim: due, unpaused processes in a worker-driven status, oldest first.
CREATE INDEX processes_due_idx ON {{schema}}.processes (next_run_at)
    WHERE status IN ('pending', 'running', 'waiting', 'compensating') AND NOT paused;
-- The console and the metrics: by status (manual_review backlog first) and age.
CREATE INDEX processes_status_idx ON {{schema}}.processes (status, updated_at);
CREATE INDEX processes_revision_of_idx ON {{schema}}.processes (revision_of) WHERE revision_of IS NOT NULL;

CREATE TABLE {{schema}}.process_steps (
    process_id       uuid        NOT NULL REFERENCES {{schema}}.processes (id),
    seq              integer     NOT NULL CHECK (seq >= 0),
    name             text        NOT NULL CHECK (octet_length(name) BETWEEN 1 AND 200),
    role             text        NOT NULL CHECK (role IN ('forward', 'compensation', 'resolution')),
    acts_on          integer,
    execution        text        NOT NULL CHECK (execution IN ('local', 'external', 'operator')),
    remote           text        CHECK (remote IN ('honours_key', 'queryable', 'none')),
    sensitive        boolean     NOT NULL DEFAULT false,
    status           text        NOT NULL DEFAULT 'pending' CHECK (status IN
                         ('pending', 'running', 'succeeded', 'retryable', 'failed', 'manual_review')),
    operation_id     uuid        NOT NULL,
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts     integer     NOT NULL CHECK (max_attempts > 0),
    next_attempt_at  timestamptz,
    first_attempt_at timestamptz,
    last_attempt_at  timestamptz,
    finished_at      timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    error_class      text        CHECK (error_class IN ('transient', 'permanent', 'unknown')),
    error_message    text        CHECK (octet_length(error_message) <= 500),
    remote_ref       text        CHECK (octet_length(remote_ref) <= 500),
    result_ref       text        CHECK (octet_length(result_ref) <= 500),
    output           jsonb,
    last_reason      text        NOT NULL CHECK (octet_length(last_reason) BETWEEN 1 AND 1000),
    last_actor       text        NOT NULL DEFAULT 'system' CHECK (octet_length(last_actor) BETWEEN 1 AND 200),
    lease_token      bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (process_id, seq),
    CONSTRAINT process_steps_name_unique UNIQUE (process_id, role, name),
    CONSTRAINT process_steps_operation_unique UNIQUE (operation_id),
    CONSTRAINT process_steps_acts_on_fk FOREIGN KEY (process_id, acts_on) REFERENCES {{schema}}.process_steps (process_id, seq),
    CONSTRAINT process_steps_linked CHECK ((role = 'forward') = (acts_on IS NULL)),
    CONSTRAINT process_steps_remote_only_external CHECK ((execution = 'external') = (remote IS NOT NULL)),
    CONSTRAINT process_steps_succeeded_has_evidence CHECK
        (status <> 'succeeded' OR result_ref IS NOT NULL OR remote_ref IS NOT NULL),
    CONSTRAINT process_steps_error_classified CHECK
        (status NOT IN ('retryable', 'failed') OR error_class IS NOT NULL),
    CONSTRAINT process_steps_retry_scheduled CHECK ((status = 'retryable') = (next_attempt_at IS NOT NULL)),
    CONSTRAINT process_steps_finished_iff_final CHECK ((status IN ('succeeded', 'failed')) = (finished_at IS NOT NULL))
);
COMMENT ON TABLE {{schema}}.process_steps IS 'One row per step of a process: the definition''s forward steps (inserted at start), compensations (inserted when compensation begins, linked to the step they undo) and operator resolutions (linked to the step they resolve). Never deleted.';
COMMENT ON COLUMN {{schema}}.process_steps.process_id IS 'The process.';
COMMENT ON COLUMN {{schema}}.process_steps.seq IS 'Position in the process: forward steps 0..n-1 in definition order, then compensations and resolutions in the order they were added.';
COMMENT ON COLUMN {{schema}}.process_steps.name IS 'Stable step name from the definition (a compensation carries the name of the step it undoes).';
COMMENT ON COLUMN {{schema}}.process_steps.role IS 'forward: a definition step; compensation: undoes the effect of acts_on; resolution: an operator''s decision about acts_on.';
COMMENT ON COLUMN {{schema}}.process_steps.acts_on IS 'seq of the step a compensation or resolution acts on; NULL for forward steps.';
COMMENT ON COLUMN {{schema}}.process_steps.execution IS 'local: effect and checkpoint in one transaction; external: a call to a remote system; operator: a person''s decision.';
COMMENT ON COLUMN {{schema}}.process_steps.remote IS 'For external steps, what the remote supports: honours_key (idempotency key), queryable (lookup by operation id), none.';
COMMENT ON COLUMN {{schema}}.process_steps.sensitive IS 'A compensation that needs an approver before it runs (it waits in manual_review).';
COMMENT ON COLUMN {{schema}}.process_steps.status IS 'pending: not tried; running: an external attempt is committed and may be in flight (outcome unknown if its worker died); succeeded; retryable: will be tried again at next_attempt_at; failed; manual_review: a person must decide.';
COMMENT ON COLUMN {{schema}}.process_steps.operation_id IS 'Stable id of the operation (md5 of process id, role and name, as a UUID): the same across retries; the idempotency key and the reference the remote is queried by.';
COMMENT ON COLUMN {{schema}}.process_steps.attempts IS 'Attempts started so far (an external attempt is counted and committed before its call).';
COMMENT ON COLUMN {{schema}}.process_steps.max_attempts IS 'Attempt limit from the retry policy.';
COMMENT ON COLUMN {{schema}}.process_steps.next_attempt_at IS 'When a retryable step is due (backoff with full jitter); NULL otherwise.';
COMMENT ON COLUMN {{schema}}.process_steps.first_attempt_at IS 'Start of the first attempt: the retry policy''s deadline counts from here.';
COMMENT ON COLUMN {{schema}}.process_steps.last_attempt_at IS 'Start of the latest attempt.';
COMMENT ON COLUMN {{schema}}.process_steps.finished_at IS 'When the step succeeded or failed for good.';
COMMENT ON COLUMN {{schema}}.process_steps.updated_at IS 'Last change of the row.';
COMMENT ON COLUMN {{schema}}.process_steps.error_class IS 'Class of the last error: transient (retry), permanent (no retry), unknown (the remote may have acted).';
COMMENT ON COLUMN {{schema}}.process_steps.error_message IS 'Last error, redacted and cut to 500 bytes (no secrets, no full responses).';
COMMENT ON COLUMN {{schema}}.process_steps.remote_ref IS 'The remote''s reference for the effect (e.g. a charge id): evidence of an external success.';
COMMENT ON COLUMN {{schema}}.process_steps.result_ref IS 'Reference to the local result (e.g. a row id) or an operator''s evidence: evidence of success.';
COMMENT ON COLUMN {{schema}}.process_steps.output IS 'Small output later steps need (never a full API response).';
COMMENT ON COLUMN {{schema}}.process_steps.last_reason IS 'Why the last transition happened.';
COMMENT ON COLUMN {{schema}}.process_steps.last_actor IS 'system or the operator who made the last transition.';
COMMENT ON COLUMN {{schema}}.process_steps.lease_token IS 'Fencing token of the worker that wrote the row last (0 for operators).';

CREATE TABLE {{schema}}.process_history (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    process_id   uuid        NOT NULL REFERENCES {{schema}}.processes (id),
    step_seq     integer,
    from_status  text,
    to_status    text        NOT NULL,
    reason       text        NOT NULL,
    actor        text        NOT NULL,
    lease_token  bigint      NOT NULL,
    at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
COMMENT ON TABLE {{schema}}.process_history IS 'Append-only record of every transition of processes and steps, written by triggers in the transaction of the change (UPDATE and DELETE refused). Its id is the audit reference of operator actions.';
COMMENT ON COLUMN {{schema}}.process_history.id IS 'Order of transitions; the audit reference.';
COMMENT ON COLUMN {{schema}}.process_history.process_id IS 'The process.';
COMMENT ON COLUMN {{schema}}.process_history.step_seq IS 'The step, or NULL for a process transition.';
COMMENT ON COLUMN {{schema}}.process_history.from_status IS 'Status before (NULL when the row was created).';
COMMENT ON COLUMN {{schema}}.process_history.to_status IS 'Status after (the same as before for a takeover, pause or resume).';
COMMENT ON COLUMN {{schema}}.process_history.reason IS 'Why.';
COMMENT ON COLUMN {{schema}}.process_history.actor IS 'system (a worker) or the operator.';
COMMENT ON COLUMN {{schema}}.process_history.lease_token IS 'Fencing token of the writing worker (0 for starts and operators).';
COMMENT ON COLUMN {{schema}}.process_history.at IS 'When.';
CREATE INDEX process_history_process_idx ON {{schema}}.process_history (process_id, id);

CREATE TABLE {{schema}}.process_transitions (
    entity       text NOT NULL CHECK (entity IN ('process', 'step')),
    from_status  text NOT NULL,
    to_status    text NOT NULL,
    PRIMARY KEY (entity, from_status, to_status)
);
COMMENT ON TABLE {{schema}}.process_transitions IS 'The allowed status transitions of processes and steps; the update triggers refuse any other.';
COMMENT ON COLUMN {{schema}}.process_transitions.entity IS 'process or step.';
COMMENT ON COLUMN {{schema}}.process_transitions.from_status IS 'Status before.';
COMMENT ON COLUMN {{schema}}.process_transitions.to_status IS 'Status after.';

INSERT INTO {{schema}}.process_transitions (entity, from_status, to_status) VALUES
    ('process', 'pending', 'running'),
    ('process', 'pending', 'cancelled'),
    ('process', 'pending', 'manual_review'),
    ('process', 'running', 'waiting'),
    ('process', 'running', 'succeeded'),
    ('process', 'running', 'failed'),
    ('process', 'running', 'compensating'),
    ('process', 'running', 'manual_review'),
    ('process', 'running', 'cancelled'),
    ('process', 'waiting', 'running'),
    ('process', 'waiting', 'manual_review'),
    ('process', 'waiting', 'cancelled'),
    ('process', 'compensating', 'compensated'),
    ('process', 'compensating', 'manual_review'),
    ('process', 'compensating', 'failed'),
    ('process', 'manual_review', 'running'),
    ('process', 'manual_review', 'compensating'),
    ('process', 'manual_review', 'succeeded'),
    ('process', 'manual_review', 'failed'),
    ('process', 'manual_review', 'compensated'),
    ('process', 'manual_review', 'cancelled'),
    ('step', 'pending', 'running'),
    ('step', 'pending', 'succeeded'),
    ('step', 'pending', 'retryable'),
    ('step', 'pending', 'failed'),
    ('step', 'pending', 'manual_review'),
    ('step', 'running', 'succeeded'),
    ('step', 'running', 'retryable'),
    ('step', 'running', 'failed'),
    ('step', 'running', 'manual_review'),
    ('step', 'retryable', 'running'),
    ('step', 'retryable', 'succeeded'),
    ('step', 'retryable', 'failed'),
    ('step', 'retryable', 'manual_review'),
    ('step', 'manual_review', 'pending'),
    ('step', 'manual_review', 'succeeded'),
    ('step', 'manual_review', 'failed'),
    ('step', 'failed', 'pending');

-- Process transitions: allowed, with evidence for terminal states, versioned, recorded.
CREATE FUNCTION {{schema}}.processes_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO {{schema}}.process_history (process_id, step_seq, from_status, to_status, reason, actor, lease_token)
        VALUES (NEW.id, NULL, NULL, NEW.status, NEW.last_reason, NEW.last_actor, 0);
        RETURN NEW;
    END IF;
    IF OLD.status IS DISTINCT FROM NEW.status THEN
        IF NOT EXISTS (SELECT 1 FROM {{schema}}.process_transitions t
                       WHERE t.entity = 'process' AND t.from_status = OLD.status AND t.to_status = NEW.status) THEN
            RAISE EXCEPTION 'process % may not go from % to %', NEW.id, OLD.status, NEW.status
                USING ERRCODE = 'check_violation', CONSTRAINT = 'processes_transition_allowed';
        END IF;
        IF NEW.status = 'succeeded' AND EXISTS (SELECT 1 FROM {{schema}}.process_steps s
                WHERE s.process_id = NEW.id AND s.role = 'forward' AND s.status <> 'succeeded') THEN
            RAISE EXCEPTION 'process % cannot succeed: a forward step has no success evidence', NEW.id
                USING ERRCODE = 'check_violation', CONSTRAINT = 'processes_succeeded_has_evidence';
        END IF;
        IF NEW.status = 'compensated' AND NOT EXISTS (SELECT 1 FROM {{schema}}.process_steps s
                WHERE s.process_id = NEW.id AND s.role = 'compensation') OR NEW.status = 'compensated' AND EXISTS (
                SELECT 1 FROM {{schema}}.process_steps s
                WHERE s.process_id = NEW.id AND s.role = 'compensation' AND s.status <> 'succeeded') THEN
            RAISE EXCEPTION 'process % cannot be compensated: a compensation has no success evidence', NEW.id
                USING ERRCODE = 'check_violation', CONSTRAINT = 'processes_compensated_has_evidence';
        END IF;
        IF NEW.status = 'failed' AND NEW.last_actor = 'system' AND NOT EXISTS (SELECT 1 FROM {{schema}}.process_steps s
                WHERE s.process_id = NEW.id AND s.status = 'failed') THEN
            RAISE EXCEPTION 'process % cannot fail without a failed step or an operator decision', NEW.id
                USING ERRCODE = 'check_violation', CONSTRAINT = 'processes_failed_has_evidence';
        END IF;
        IF NEW.status = 'cancelled' AND NEW.last_actor = 'system' THEN
            RAISE EXCEPTION 'process % can only be cancelled by an operator', NEW.id
                USING ERRCODE = 'check_violation', CONSTRAINT = 'processes_cancelled_by_operator';
        END IF;
    END IF;
    IF OLD.status IS DISTINCT FROM NEW.status OR OLD.last_reason IS DISTINCT FROM NEW.last_reason
       OR OLD.paused IS DISTINCT FROM NEW.paused THEN
        NEW.row_version := OLD.row_version + 1;
        INSERT INTO {{schema}}.process_history (process_id, step_seq, from_status, to_status, reason, actor, lease_token)
        VALUES (NEW.id, NULL, OLD.status, NEW.status, NEW.last_reason, NEW.last_actor,
                CASE WHEN NEW.last_actor = 'system' THEN NEW.lease_token ELSE 0 END);
    END IF;
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION {{schema}}.processes_transition() IS 'Trigger function on processes: refuses transitions not in process_transitions and terminal states without their evidence (succeeded: every forward step succeeded; compensated: every compensation succeeded; failed: a failed step or an operator; cancelled: an operator), bumps row_version and records the transition in process_history.';
CREATE TRIGGER processes_transition BEFORE UPDATE ON {{schema}}.processes
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.processes_transition();
-- The creation is recorded after the row exists (the history row references it).
CREATE TRIGGER processes_created AFTER INSERT ON {{schema}}.processes
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.processes_transition();

CREATE FUNCTION {{schema}}.process_steps_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.role <> 'forward' THEN
            INSERT INTO {{schema}}.process_history (process_id, step_seq, from_status, to_status, reason, actor, lease_token)
            VALUES (NEW.process_id, NEW.seq, NULL, NEW.status, NEW.last_reason, NEW.last_actor, NEW.lease_token);
        END IF;
        RETURN NEW;
    END IF;
    IF OLD.status IS DISTINCT FROM NEW.status OR OLD.last_reason IS DISTINCT FROM NEW.last_reason THEN
        IF OLD.status IS DISTINCT FROM NEW.status AND NOT EXISTS (SELECT 1 FROM {{schema}}.process_transitions t
                WHERE t.entity = 'step' AND t.from_status = OLD.status AND t.to_status = NEW.status) THEN
            RAISE EXCEPTION 'step % of process % may not go from % to %', NEW.seq, NEW.process_id, OLD.status, NEW.status
                USING ERRCODE = 'check_violation', CONSTRAINT = 'process_steps_transition_allowed';
        END IF;
        INSERT INTO {{schema}}.process_history (process_id, step_seq, from_status, to_status, reason, actor, lease_token)
        VALUES (NEW.process_id, NEW.seq, OLD.status, NEW.status, NEW.last_reason, NEW.last_actor, NEW.lease_token);
    END IF;
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION {{schema}}.process_steps_transition() IS 'Trigger function on process_steps: refuses transitions not in process_transitions and records every transition (and every compensation or resolution step added) in process_history.';
CREATE TRIGGER process_steps_transition BEFORE UPDATE ON {{schema}}.process_steps
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.process_steps_transition();
CREATE TRIGGER process_steps_created AFTER INSERT ON {{schema}}.process_steps
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.process_steps_transition();

CREATE FUNCTION {{schema}}.process_history_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'process_history is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END
$$;
COMMENT ON FUNCTION {{schema}}.process_history_append_only() IS 'Trigger function refusing UPDATE and DELETE on process_history: history is never rewritten.';
CREATE TRIGGER process_history_append_only BEFORE UPDATE OR DELETE ON {{schema}}.process_history
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.process_history_append_only();
