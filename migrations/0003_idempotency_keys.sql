-- Idempotency records of the HTTP idempotency layer (the `idempotency` crate): any route of a service
-- that takes an Idempotency-Key reserves a record here before its effect, completes it in the
-- effect's own transaction and replays the stored response to retries.
--
-- Every time written (created_at, updated_at, expires_at, lease_expires_at) comes from the
-- application clock, passed as a parameter, so expiry decisions use one clock.

CREATE TABLE {{schema}}.idempotency_keys (
    scope             text        NOT NULL CHECK (scope <> ''),
    operation         text        NOT NULL CHECK (octet_length(operation) BETWEEN 1 AND 200),
    key_hash          bytea       NOT NULL CHECK (octet_length(key_hash) = 32),
    fingerprint       bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    status            text        NOT NULL CHECK (status IN ('processing', 'completed', 'failed', 'pending')),
    response_status   smallint    CHECK (response_status BETWEEN 100 AND 599),
    response_body     text,
    resource_id       uuid,
    lease_token       uuid,
    lease_expires_at  timestamptz,
    created_at        timestamptz NOT NULL,
    updated_at        timestamptz NOT NULL,
    expires_at        timestamptz NOT NULL,
    PRIMARY KEY (scope, operation, key_hash),
    CONSTRAINT idempotency_keys_lease CHECK ((status = 'processing') = (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT idempotency_keys_response CHECK ((status = 'processing') = (response_status IS NULL AND response_body IS NULL)),
    CONSTRAINT idempotency_keys_failed_is_error CHECK (status <> 'failed' OR response_status >= 400),
    CONSTRAINT idempotency_keys_success_is_2xx CHECK (status NOT IN ('completed', 'pending') OR response_status BETWEEN 200 AND 299),
    CONSTRAINT idempotency_keys_pending_has_resource CHECK (status <> 'pending' OR resource_id IS NOT NULL),
    CONSTRAINT idempotency_keys_expires_after_creation CHECK (expires_at > created_at)
);
COMMENT ON TABLE {{schema}}.idempotency_keys IS 'One record per (scope, operation, Idempotency-Key): reserved through the primary key before any effect, completed in the effect''s own transaction, replayed to retries, purged after expiry.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.scope IS 'Whose key it is, as the service''s own authentication decides (a tenant, an account, a principal): the same key in two scopes never collides.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.operation IS 'The operation the key was used for (by default the method and route, e.g. POST /refunds): the same key on two operations never collides.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.key_hash IS 'SHA-256 of the Idempotency-Key header value; the key itself is not stored.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.fingerprint IS 'SHA-256 of the canonical JSON (sorted keys, no whitespace) of the validated request and the operation; a reuse with another fingerprint is rejected with 422.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.status IS 'processing: reserved, effect not committed (holds a lease); completed: final response stored; failed: definitive business error stored; pending: accepted, downstream outcome not known yet (202).';
COMMENT ON COLUMN {{schema}}.idempotency_keys.response_status IS 'HTTP status of the stored response, replayed to retries; NULL while processing.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.response_body IS 'Exact JSON body of the stored response (text, not jsonb, so replays are byte-identical); NULL while processing.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.resource_id IS 'Id of the created resource, if any (gives the Location header of replays).';
COMMENT ON COLUMN {{schema}}.idempotency_keys.lease_token IS 'Fencing token of the current holder of a processing record; completion and release compare it, so a holder whose lease was taken over cannot complete. NULL once final.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.lease_expires_at IS 'End of the processing lease; after it another request with the same key and payload takes the record over. NULL once final.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.created_at IS 'Reservation time (application clock).';
COMMENT ON COLUMN {{schema}}.idempotency_keys.updated_at IS 'Last change (reservation, takeover, completion).';
COMMENT ON COLUMN {{schema}}.idempotency_keys.expires_at IS 'End of retention (created_at + TTL, 24 h by default): afterwards the key counts as new and completed or failed records are purged. Pending records are kept until resolved.';

-- The purge reads expired final records and abandoned reservations.
CREATE INDEX idempotency_keys_expired_idx ON {{schema}}.idempotency_keys (expires_at) WHERE status IN ('completed', 'failed');
CREATE INDEX idempotency_keys_processing_idx ON {{schema}}.idempotency_keys (lease_expires_at) WHERE status = 'processing';
-- Resolving a pending record finds it by its resource.
CREATE INDEX idempotency_keys_pending_idx ON {{schema}}.idempotency_keys (resource_id) WHERE status = 'pending';
