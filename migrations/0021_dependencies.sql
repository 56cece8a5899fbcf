-- Dependencies (issue 38): a remote the application calls (a payment provider, a downstream API)
-- is a named row with a circuit every worker and instance shares, so an outage is waited out in
-- one place instead of being spent as attempts by each caller. Owned by the `breaker` crate.
--
-- A step refused because its remote is unavailable (503, 429, connection refused: nothing was
-- done) is a new error class, `unavailable`: it waits without spending attempts; only its
-- business deadline applies. `waiting_for` names the dependency it waits on, `waiting_since` the
-- start of the wait (the wake-up takes the oldest first).

CREATE TABLE {{schema}}.dependencies (
    name                text        PRIMARY KEY CHECK (name ~ '^[A-Za-z0-9._-]{1,100}$'),
    state               text        NOT NULL DEFAULT 'closed' CHECK (state IN ('closed', 'open', 'half_open')),
    forced_open         boolean     NOT NULL DEFAULT false,
    consecutive         integer     NOT NULL DEFAULT 0 CHECK (consecutive >= 0),
    window_started_at   timestamptz,
    window_calls        integer     NOT NULL DEFAULT 0 CHECK (window_calls >= 0),
    window_unavailable  integer     NOT NULL DEFAULT 0 CHECK (window_unavailable >= 0),
    down_since          timestamptz,
    cooldown_ms         bigint      NOT NULL DEFAULT 0 CHECK (cooldown_ms >= 0),
    probe_at            timestamptz,
    probe_until         timestamptz,
    last_error          text        CHECK (octet_length(last_error) <= 500),
    last_error_at       timestamptz,
    last_reason         text        NOT NULL DEFAULT 'declared' CHECK (octet_length(last_reason) BETWEEN 1 AND 1000),
    last_actor          text        NOT NULL DEFAULT 'system' CHECK (octet_length(last_actor) BETWEEN 1 AND 200),
    tokens              double precision,
    tokens_at           timestamptz,
    resumed_at          timestamptz,
    version             bigint      NOT NULL DEFAULT 0,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT dependencies_open_has_probe_time CHECK (state <> 'open' OR probe_at IS NOT NULL),
    CONSTRAINT dependencies_half_open_has_probe CHECK (state <> 'half_open' OR probe_until IS NOT NULL),
    CONSTRAINT dependencies_down_since_iff_not_closed CHECK ((state = 'closed') = (down_since IS NULL) OR forced_open)
);
COMMENT ON TABLE {{schema}}.dependencies IS 'One row per remote dependency (breaker crate): its circuit, shared by every worker and instance, and its rate limiter''s bucket. Created on first use.';
COMMENT ON COLUMN {{schema}}.dependencies.name IS 'The dependency''s name as the application declares it (e.g. provider).';
COMMENT ON COLUMN {{schema}}.dependencies.state IS 'closed: calls go through; open: calls wait until probe_at; half_open: one probe call is in flight until probe_until, the others wait.';
COMMENT ON COLUMN {{schema}}.dependencies.forced_open IS 'Set by an operator: every call waits until an operator closes the circuit again.';
COMMENT ON COLUMN {{schema}}.dependencies.consecutive IS 'Unavailable answers in a row while closed (the circuit opens at the policy''s threshold).';
COMMENT ON COLUMN {{schema}}.dependencies.window_started_at IS 'Start of the failure-rate window (only with a failure-rate rule).';
COMMENT ON COLUMN {{schema}}.dependencies.window_calls IS 'Calls answered in the window.';
COMMENT ON COLUMN {{schema}}.dependencies.window_unavailable IS 'Of them, unavailable.';
COMMENT ON COLUMN {{schema}}.dependencies.down_since IS 'When the circuit opened for the current outage (kept through probes that fail); NULL while closed.';
COMMENT ON COLUMN {{schema}}.dependencies.cooldown_ms IS 'The current cool-down: doubled by every failed probe up to the policy''s maximum.';
COMMENT ON COLUMN {{schema}}.dependencies.probe_at IS 'While open: the earliest probe (the cool-down''s end, or the remote''s Retry-After if later).';
COMMENT ON COLUMN {{schema}}.dependencies.probe_until IS 'While half open: the probe''s lease; after it another caller may probe.';
COMMENT ON COLUMN {{schema}}.dependencies.last_error IS 'The last unavailable answer, redacted and cut to 500 bytes.';
COMMENT ON COLUMN {{schema}}.dependencies.last_reason IS 'Why the last change happened (recorded in dependency_history when the state changes).';
COMMENT ON COLUMN {{schema}}.dependencies.last_actor IS 'system or the operator who made the last change.';
COMMENT ON COLUMN {{schema}}.dependencies.tokens IS 'The rate limiter''s tokens at tokens_at (NULL without a rate limit).';
COMMENT ON COLUMN {{schema}}.dependencies.resumed_at IS 'When waiting work was last woken (one wake-up a second across all instances, at the policy''s resume rate).';
COMMENT ON COLUMN {{schema}}.dependencies.version IS 'Incremented on every change of the circuit: writes compare and set it.';
COMMENT ON COLUMN {{schema}}.dependencies.last_error_at IS 'When last_error changed.';
COMMENT ON COLUMN {{schema}}.dependencies.tokens_at IS 'When tokens was last computed (the bucket refills from there at the policy''s rate).';
COMMENT ON COLUMN {{schema}}.dependencies.updated_at IS 'Last change of the circuit.';

CREATE TABLE {{schema}}.dependency_slots (
    name        text        NOT NULL REFERENCES {{schema}}.dependencies (name) ON DELETE CASCADE,
    slot        integer     NOT NULL CHECK (slot >= 0),
    holder      uuid,
    held_until  timestamptz,
    PRIMARY KEY (name, slot),
    CONSTRAINT dependency_slots_held_pair CHECK ((holder IS NULL) = (held_until IS NULL))
);
COMMENT ON TABLE {{schema}}.dependency_slots IS 'The concurrency cap of a dependency across all instances: one row per allowed call in flight; a call holds a slot until it ends or held_until passes (a crashed holder''s slot comes back).';
COMMENT ON COLUMN {{schema}}.dependency_slots.name IS 'The dependency.';
COMMENT ON COLUMN {{schema}}.dependency_slots.slot IS 'The slot''s number, 0 to the cap - 1.';
COMMENT ON COLUMN {{schema}}.dependency_slots.holder IS 'The process (instance) whose call holds the slot; NULL when free.';
COMMENT ON COLUMN {{schema}}.dependency_slots.held_until IS 'The hold''s lease: after it the slot is free again, whoever held it.';

CREATE TABLE {{schema}}.dependency_history (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text        NOT NULL,
    from_state  text,
    to_state    text        NOT NULL,
    forced_open boolean     NOT NULL,
    reason      text        NOT NULL,
    actor       text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
COMMENT ON TABLE {{schema}}.dependency_history IS 'Append-only record of every circuit transition and operator action on dependencies, written by a trigger in the transaction of the change.';
COMMENT ON COLUMN {{schema}}.dependency_history.id IS 'Order of the entries.';
COMMENT ON COLUMN {{schema}}.dependency_history.name IS 'The dependency.';
COMMENT ON COLUMN {{schema}}.dependency_history.from_state IS 'The state before (NULL when the row was created).';
COMMENT ON COLUMN {{schema}}.dependency_history.to_state IS 'The state after.';
COMMENT ON COLUMN {{schema}}.dependency_history.forced_open IS 'Whether an operator held the circuit open after the change.';
COMMENT ON COLUMN {{schema}}.dependency_history.reason IS 'Why (the circuit''s reason, or the operator''s with "opened by hand:" or "closed by hand:").';
COMMENT ON COLUMN {{schema}}.dependency_history.actor IS 'system or the operator.';
COMMENT ON COLUMN {{schema}}.dependency_history.at IS 'When.';
CREATE INDEX dependency_history_name_idx ON {{schema}}.dependency_history (name, id);

CREATE FUNCTION {{schema}}.dependencies_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR OLD.state IS DISTINCT FROM NEW.state OR OLD.forced_open IS DISTINCT FROM NEW.forced_open
       OR NEW.last_actor <> 'system' THEN
        INSERT INTO {{schema}}.dependency_history (name, from_state, to_state, forced_open, reason, actor)
        VALUES (NEW.name, CASE WHEN TG_OP = 'UPDATE' THEN OLD.state END, NEW.state, NEW.forced_open,
                NEW.last_reason, NEW.last_actor);
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER dependencies_transition AFTER INSERT OR UPDATE ON {{schema}}.dependencies
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.dependencies_transition();

CREATE FUNCTION {{schema}}.dependency_history_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'dependency_history is append-only' USING ERRCODE = 'insufficient_privilege';
END
$$;
CREATE TRIGGER dependency_history_append_only BEFORE UPDATE OR DELETE ON {{schema}}.dependency_history
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.dependency_history_append_only();

-- Process steps: the unavailable class, and what a step waits for.
ALTER TABLE {{schema}}.process_steps DROP CONSTRAINT process_steps_error_class_check;
ALTER TABLE {{schema}}.process_steps ADD CONSTRAINT process_steps_error_class_check
    CHECK (error_class IN ('transient', 'permanent', 'unknown', 'unavailable'));
ALTER TABLE {{schema}}.process_steps
    ADD COLUMN waiting_for   text CHECK (octet_length(waiting_for) BETWEEN 1 AND 100),
    ADD COLUMN waiting_since timestamptz;
-- Only a retryable step waits: any other change of status (an attempt, an operator's action, a
-- deadline) ends the wait, whichever statement makes it.
CREATE FUNCTION {{schema}}.process_steps_end_wait() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status <> 'retryable' THEN
        NEW.waiting_for := NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER process_steps_end_wait BEFORE UPDATE OF status ON {{schema}}.process_steps
    FOR EACH ROW WHEN (NEW.status <> 'retryable' AND NEW.waiting_for IS NOT NULL)
    EXECUTE FUNCTION {{schema}}.process_steps_end_wait();
COMMENT ON COLUMN {{schema}}.process_steps.error_class IS 'Class of the last error: transient (retry), permanent (no retry), unknown (the remote may have acted), unavailable (the remote refused before doing anything: wait, no attempt spent).';
COMMENT ON COLUMN {{schema}}.process_steps.waiting_for IS 'The dependency whose circuit this retryable step waits on (woken oldest first, at the dependency''s resume rate, once it may be called); NULL otherwise.';
COMMENT ON COLUMN {{schema}}.process_steps.waiting_since IS 'Since when the step has been waiting for an unavailable remote (kept through the probes it makes, cleared by any other outcome).';
COMMENT ON COLUMN {{schema}}.process_steps.first_attempt_at IS 'Start of the first attempt, or of the first wait for an unavailable remote: the retry policy''s (business) deadline counts from here.';

-- The wake-up: the oldest waiters of a dependency.
CREATE INDEX process_steps_waiting_for_idx ON {{schema}}.process_steps (waiting_for, waiting_since)
    WHERE waiting_for IS NOT NULL;
