-- What the console needs to show a process and the system at a glance (issue 23, "look rather
-- than read"): a compensation's business name, and the console's own samples for the overview's
-- charts.

-- A compensation is named for what it does ("refund", "release"), not for the step it undoes:
-- the definition gives the label, the runner stores it when it adds the compensation step.
ALTER TABLE {{schema}}.process_steps ADD COLUMN compensation_label text
    CHECK (compensation_label IS NULL OR octet_length(compensation_label) BETWEEN 1 AND 100);
COMMENT ON COLUMN {{schema}}.process_steps.compensation_label IS 'For a compensation step: what it does in business words (refund, release), from the definition (Step::compensate_as); NULL for other steps and for compensations without a label (shown as "undo <step>").';

-- Links from an order or payment to its processes look processes up by business key alone (the
-- unique constraint leads with kind).
CREATE INDEX processes_business_key ON {{schema}}.processes (business_key);
COMMENT ON INDEX {{schema}}.processes_business_key IS 'Finds the processes of a business key (processes::look::of_key), whatever their kind.';

-- The overview's charts over the last hour: the console's sampler writes one row per series per
-- interval (default a minute), read through the owning crates' functions; rows older than two
-- days are pruned by the sampler itself.
CREATE TABLE {{schema}}.console_samples (
    at     timestamptz      NOT NULL DEFAULT now(),
    series text             NOT NULL CHECK (octet_length(series) BETWEEN 1 AND 300),
    value  double precision NOT NULL,
    PRIMARY KEY (series, at)
);
CREATE INDEX console_samples_at ON {{schema}}.console_samples (at);
COMMENT ON TABLE {{schema}}.console_samples IS 'Owned by the console: what its sampler measured each interval for the overview''s charts (outbox backlog and age, manual-review backlog, dead letters); pruned after two days. Nothing else reads or writes it.';
COMMENT ON COLUMN {{schema}}.console_samples.at IS 'When the sample was taken.';
COMMENT ON COLUMN {{schema}}.console_samples.series IS 'What was measured: outbox_pending, outbox_oldest_seconds, outbox_dead, manual_review, dead_letters:<consumer>.';
COMMENT ON COLUMN {{schema}}.console_samples.value IS 'The measured value (a count, or seconds for an age).';
