-- Corrected descriptions of two idempotency-record columns (the layer's operation is the name a
-- service gives it; the fingerprint covers the request's method and target since version 2).
COMMENT ON COLUMN {{schema}}.idempotency_keys.operation IS 'The operation the key was used for, as named by the service (Idempotency::route, e.g. create_refund): the same key on two operations never collides.';
COMMENT ON COLUMN {{schema}}.idempotency_keys.fingerprint IS 'SHA-256 of the canonical JSON (sorted keys, no whitespace) of the operation, the request''s method and target (path and query) and the validated request (fingerprint version 2; records written before it hold version 1, without method and target, and still match); a reuse with another fingerprint is rejected with 422.';
