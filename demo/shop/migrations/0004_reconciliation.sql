-- Regular reconciliation with the payment provider (issue 25, item 5): each mismatch between the
-- provider's records and the local payments becomes a case for a person, with its evidence. The
-- job never moves money: it only opens cases, and closes the ones it no longer observes.

CREATE TABLE demo.reconciliation_cases (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id   uuid        NOT NULL REFERENCES demo.payments (id),
    kind         text        NOT NULL CHECK (kind IN
                     ('charged_not_recorded', 'recorded_not_charged', 'amount_mismatch', 'pending_too_long')),
    evidence     jsonb       NOT NULL,
    found_at     timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    resolved_at  timestamptz,
    resolution   text,
    CONSTRAINT reconciliation_cases_resolution CHECK ((resolved_at IS NULL) = (resolution IS NULL))
);
-- One open case per payment and kind.
CREATE UNIQUE INDEX reconciliation_cases_open_idx ON demo.reconciliation_cases (payment_id, kind)
    WHERE resolved_at IS NULL;
COMMENT ON TABLE demo.reconciliation_cases IS 'Mismatches the reconciliation job found between the provider''s charges and demo.payments, one open case per payment and kind, for manual review. Never deleted.';
COMMENT ON COLUMN demo.reconciliation_cases.kind IS 'charged_not_recorded: money taken at the provider, the payment failed or undecided locally; recorded_not_charged: succeeded locally, absent or declined at the provider; amount_mismatch: amount or currency differ; pending_too_long: undecided locally past the threshold.';
COMMENT ON COLUMN demo.reconciliation_cases.evidence IS 'The local payment and the provider''s charges as the job saw them.';
COMMENT ON COLUMN demo.reconciliation_cases.found_at IS 'First run that found it.';
COMMENT ON COLUMN demo.reconciliation_cases.last_seen_at IS 'Latest run that still found it.';
COMMENT ON COLUMN demo.reconciliation_cases.resolved_at IS 'When it was closed (a run no longer found the mismatch, or a person resolved it).';
COMMENT ON COLUMN demo.reconciliation_cases.resolution IS 'How it was closed.';
