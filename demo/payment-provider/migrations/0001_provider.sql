-- The payment provider simulator's own state, in its own schema `provider` (created by the
-- migrator, history in provider._migrations). Nothing here is part of the outbox product or of
-- the shop: in a real deployment this would be someone else's database.

CREATE TABLE provider.charges (
    id              uuid        PRIMARY KEY,
    reference       text        NOT NULL
        CONSTRAINT charges_reference_length CHECK (length(reference) BETWEEN 1 AND 200),
    amount          bigint      NOT NULL
        CONSTRAINT charges_amount_positive CHECK (amount > 0),
    currency        text        NOT NULL
        CONSTRAINT charges_currency_iso CHECK (currency ~ '^[A-Z]{3}$'),
    status          text        NOT NULL
        CONSTRAINT charges_status_known CHECK (status IN ('succeeded', 'declined', 'refunded')),
    idempotency_key text
        CONSTRAINT charges_idempotency_key_unique UNIQUE
        CONSTRAINT charges_idempotency_key_length CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    refunded_at     timestamptz,
    CONSTRAINT charges_refunded_at_iff_refunded CHECK ((status = 'refunded') = (refunded_at IS NOT NULL))
);

COMMENT ON TABLE provider.charges IS
    'Every charge the simulated payment provider made or declined, one row per accepted POST /charges (replays of an Idempotency-Key add none).';
COMMENT ON COLUMN provider.charges.id IS 'The provider''s charge id, returned to the caller.';
COMMENT ON COLUMN provider.charges.reference IS
    'The caller''s reference for the payment (stable across its retries); GET /charges?reference= looks it up.';
COMMENT ON COLUMN provider.charges.amount IS 'Amount in minor units of the currency (cents), positive.';
COMMENT ON COLUMN provider.charges.currency IS 'ISO 4217 currency code, three capital letters.';
COMMENT ON COLUMN provider.charges.status IS
    'succeeded (money taken), declined (definitive refusal, nothing taken) or refunded (taken, then given back).';
COMMENT ON COLUMN provider.charges.idempotency_key IS
    'The Idempotency-Key the charge was made with; unique, so concurrent requests with one key make one charge. NULL without a key or with PROVIDER_IDEMPOTENCY=off.';
COMMENT ON COLUMN provider.charges.created_at IS 'When the charge was committed.';
COMMENT ON COLUMN provider.charges.refunded_at IS 'When the charge was refunded; set exactly when status is refunded.';

-- GET /charges?reference=...: all charges of one reference, oldest first.
CREATE INDEX charges_reference_created ON provider.charges (reference, created_at);

CREATE TABLE provider.refunds (
    id         uuid        PRIMARY KEY,
    charge_id  uuid        NOT NULL
        CONSTRAINT refunds_charge_exists REFERENCES provider.charges (id)
        CONSTRAINT refunds_one_per_charge UNIQUE,
    amount     bigint      NOT NULL
        CONSTRAINT refunds_amount_positive CHECK (amount > 0),
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

COMMENT ON TABLE provider.refunds IS
    'Refunds: always of the whole charge, at most one per charge (a second POST /refunds answers the first).';
COMMENT ON COLUMN provider.refunds.id IS 'The provider''s refund id.';
COMMENT ON COLUMN provider.refunds.charge_id IS 'The refunded charge; unique, so a charge is refunded once.';
COMMENT ON COLUMN provider.refunds.amount IS 'Amount given back, in minor units: the whole charge.';
COMMENT ON COLUMN provider.refunds.created_at IS 'When the refund was committed.';
