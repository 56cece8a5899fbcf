-- Async confirmation (PROVIDER_MODE=async): a charge can be `pending` until the provider decides
-- it, and every change of such a charge becomes a signed webhook event in provider.events, sent to
-- PROVIDER_WEBHOOK_URL with retries.

ALTER TABLE provider.charges DROP CONSTRAINT charges_status_known;
ALTER TABLE provider.charges ADD CONSTRAINT charges_status_known
    CHECK (status IN ('pending', 'succeeded', 'declined', 'refunded'));

ALTER TABLE provider.charges
    ADD COLUMN confirmation text NOT NULL DEFAULT 'sync'
        CONSTRAINT charges_confirmation_known CHECK (confirmation IN ('sync', 'async')),
    ADD COLUMN planned_status text
        CONSTRAINT charges_planned_status_known CHECK (planned_status IN ('succeeded', 'declined')),
    ADD COLUMN decide_at timestamptz,
    ADD CONSTRAINT charges_pending_is_planned
        CHECK (status <> 'pending' OR (planned_status IS NOT NULL AND decide_at IS NOT NULL)),
    ADD CONSTRAINT charges_pending_is_async CHECK (status <> 'pending' OR confirmation = 'async');

COMMENT ON COLUMN provider.charges.status IS
    'pending (async mode, not decided yet), succeeded (money taken), declined (definitive refusal, nothing taken) or refunded (taken, then given back).';
COMMENT ON COLUMN provider.charges.confirmation IS
    'sync: POST /charges answered the outcome; async: it answered 202 pending, and this charge''s changes are confirmed by webhook events.';
COMMENT ON COLUMN provider.charges.planned_status IS
    'For an async charge: the outcome drawn when it was accepted (declined if the decline fault struck), applied at decide_at.';
COMMENT ON COLUMN provider.charges.decide_at IS
    'For an async charge: when the provider decides it (creation + PROVIDER_CONFIRM_DELAY).';

-- The decider looks for pending charges that are due.
CREATE INDEX charges_pending_decide_at ON provider.charges (decide_at) WHERE status = 'pending';

CREATE TABLE provider.events (
    id              text        PRIMARY KEY
        CONSTRAINT events_id_form CHECK (id ~ '^evt_[0-9a-f]{32}$'),
    charge_id       uuid        NOT NULL CONSTRAINT events_charge_exists REFERENCES provider.charges (id),
    type            text        NOT NULL
        CONSTRAINT events_type_known CHECK (type IN ('charge.succeeded', 'charge.failed', 'charge.refunded')),
    body            text        NOT NULL,
    faults          text[]      NOT NULL DEFAULT '{}',
    status          text        NOT NULL
        CONSTRAINT events_status_known CHECK (status IN ('scheduled', 'delivered', 'failed', 'lost')),
    held            boolean     NOT NULL DEFAULT false,
    attempts        integer     NOT NULL DEFAULT 0 CONSTRAINT events_attempts_nonnegative CHECK (attempts >= 0),
    sends           integer     NOT NULL DEFAULT 0 CONSTRAINT events_sends_nonnegative CHECK (sends >= 0),
    next_attempt_at timestamptz,
    last_response   text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at    timestamptz,
    CONSTRAINT events_scheduled_has_time CHECK ((status = 'scheduled') = (next_attempt_at IS NOT NULL)),
    CONSTRAINT events_delivered_has_time CHECK ((status = 'delivered') = (delivered_at IS NOT NULL))
);

COMMENT ON TABLE provider.events IS
    'Webhook events of async charges, one row per event (its id is unique; duplicates and retries send the same row again). GET /admin/events lists them.';
COMMENT ON COLUMN provider.events.id IS 'The event id (evt_ + 32 hex digits), unique: receivers deduplicate by it.';
COMMENT ON COLUMN provider.events.charge_id IS 'The charge the event is about.';
COMMENT ON COLUMN provider.events.type IS 'charge.succeeded, charge.failed (declined) or charge.refunded.';
COMMENT ON COLUMN provider.events.body IS 'The exact JSON body sent, every time: {"id", "type", "created", "data": {"object": charge}}.';
COMMENT ON COLUMN provider.events.faults IS 'The webhook faults that struck this event (webhook_lost, webhook_duplicate, webhook_delay, webhook_reorder, webhook_5xx_retry).';
COMMENT ON COLUMN provider.events.status IS
    'scheduled (to be sent at next_attempt_at), delivered (a 2xx came back), failed (gave up after PROVIDER_WEBHOOK_MAX_ATTEMPTS), lost (webhook_lost: never sent).';
COMMENT ON COLUMN provider.events.held IS
    'webhook_reorder: held back until a later event of the same charge was delivered (or the reorder window passed).';
COMMENT ON COLUMN provider.events.attempts IS 'Deliveries tried (each a POST; a webhook_duplicate copy is not an attempt).';
COMMENT ON COLUMN provider.events.sends IS 'POSTs made for this event, duplicates included.';
COMMENT ON COLUMN provider.events.next_attempt_at IS 'When the next delivery is due; set exactly while scheduled.';
COMMENT ON COLUMN provider.events.last_response IS 'What the last attempt got: the HTTP status, or the transport error.';
COMMENT ON COLUMN provider.events.created_at IS 'When the event happened (the charge was decided or refunded).';
COMMENT ON COLUMN provider.events.delivered_at IS 'When the first 2xx came back; set exactly when delivered.';

-- The deliverer looks for due events; the reorder release and /admin/events?charge_id= by charge.
CREATE INDEX events_due ON provider.events (next_attempt_at) WHERE status = 'scheduled';
CREATE INDEX events_charge ON provider.events (charge_id, created_at);
