-- The producer API: tenants' API keys, orders, payments and the idempotency records of POST requests.
--
-- Every time the producer writes (created_at, updated_at, expires_at, lease_expires_at) comes from the
-- application clock, passed as a parameter, so expiry decisions use one clock. The only exception is
-- the trigger that resolves pending payment records (updated_at = now()), which decides nothing.

CREATE TABLE api_keys (
    id          uuid        PRIMARY KEY,
    tenant      text        NOT NULL CHECK (tenant ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'),
    key_hash    bytea       NOT NULL CHECK (octet_length(key_hash) = 32),
    key_prefix  text        NOT NULL CHECK (length(key_prefix) BETWEEN 1 AND 16),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,
    CONSTRAINT api_keys_key_hash_key UNIQUE (key_hash)
);
COMMENT ON TABLE api_keys IS 'Bearer API keys of the producer HTTP API; each key belongs to one tenant. Only a hash of the key is stored.';
COMMENT ON COLUMN api_keys.id IS 'Key id, for operators (revocation, audit).';
COMMENT ON COLUMN api_keys.tenant IS 'Tenant the key authenticates as; scopes every resource and idempotency key.';
COMMENT ON COLUMN api_keys.key_hash IS 'SHA-256 of the full key. Keys are 256-bit random values, so an unsalted hash is safe; the key itself is shown once at creation.';
COMMENT ON COLUMN api_keys.key_prefix IS 'First characters of the key (not secret), so operators can tell keys apart.';
COMMENT ON COLUMN api_keys.created_at IS 'Creation time.';
COMMENT ON COLUMN api_keys.revoked_at IS 'Set when the key was revoked; a revoked key no longer authenticates.';

CREATE TABLE orders (
    id            uuid        PRIMARY KEY,
    tenant        text        NOT NULL CHECK (tenant <> ''),
    customer_id   text        NOT NULL CHECK (length(customer_id) BETWEEN 1 AND 255),
    currency      text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    total_amount  bigint      NOT NULL CHECK (total_amount > 0),
    status        text        NOT NULL DEFAULT 'placed' CHECK (status IN ('placed', 'paid', 'cancelled')),
    created_at    timestamptz NOT NULL
);
COMMENT ON TABLE orders IS 'Orders placed through POST /orders; each insert is accompanied by an order.placed outbox event in the same transaction.';
COMMENT ON COLUMN orders.id IS 'Order id (UUIDv7), the aggregate_id of its events.';
COMMENT ON COLUMN orders.tenant IS 'Owning tenant; other tenants never see the order.';
COMMENT ON COLUMN orders.customer_id IS 'Caller-supplied customer reference.';
COMMENT ON COLUMN orders.currency IS 'ISO 4217 style code: three upper-case letters.';
COMMENT ON COLUMN orders.total_amount IS 'Sum of the line totals in minor units, computed with checked arithmetic.';
COMMENT ON COLUMN orders.status IS 'placed: accepted; paid and cancelled are set downstream.';
COMMENT ON COLUMN orders.created_at IS 'Acceptance time (application clock).';

CREATE TABLE order_items (
    order_id    uuid    NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    line_no     integer NOT NULL CHECK (line_no >= 1),
    sku         text    NOT NULL CHECK (length(sku) BETWEEN 1 AND 64),
    quantity    bigint  NOT NULL CHECK (quantity > 0),
    unit_price  bigint  NOT NULL CHECK (unit_price > 0),
    line_total  bigint  NOT NULL CHECK (line_total > 0),
    PRIMARY KEY (order_id, line_no)
);
COMMENT ON TABLE order_items IS 'Lines of an order, in the order the client sent them.';
COMMENT ON COLUMN order_items.order_id IS 'The order this line belongs to.';
COMMENT ON COLUMN order_items.line_no IS 'Position of the line in the request, from 1.';
COMMENT ON COLUMN order_items.sku IS 'Stock keeping unit as sent by the client.';
COMMENT ON COLUMN order_items.quantity IS 'Number of units, > 0.';
COMMENT ON COLUMN order_items.unit_price IS 'Price of one unit in minor units, > 0.';
COMMENT ON COLUMN order_items.line_total IS 'quantity * unit_price in minor units (checked).';

CREATE TABLE payments (
    id          uuid        PRIMARY KEY,
    tenant      text        NOT NULL CHECK (tenant <> ''),
    order_id    uuid        NOT NULL REFERENCES orders (id),
    amount      bigint      NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status      text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'succeeded', 'failed')),
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL
);
CREATE INDEX payments_order_id_idx ON payments (order_id);
COMMENT ON TABLE payments IS 'Payments requested through POST /payments. The charge happens downstream (payment.requested event through the outbox); the API only records the request.';
COMMENT ON COLUMN payments.id IS 'Payment id (UUIDv7), the aggregate_id of its events.';
COMMENT ON COLUMN payments.tenant IS 'Owning tenant; equals the tenant of the order.';
COMMENT ON COLUMN payments.order_id IS 'The order being paid.';
COMMENT ON COLUMN payments.amount IS 'Amount in minor units, > 0.';
COMMENT ON COLUMN payments.currency IS 'Three upper-case letters; equals the order currency.';
COMMENT ON COLUMN payments.status IS 'pending: requested, outcome not known yet; succeeded or failed: set by the downstream charge.';
COMMENT ON COLUMN payments.created_at IS 'Request time (application clock).';
COMMENT ON COLUMN payments.updated_at IS 'Last status change.';

CREATE TABLE idempotency_keys (
    tenant            text        NOT NULL CHECK (tenant <> ''),
    operation         text        NOT NULL CHECK (operation IN ('create_order', 'create_payment')),
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
    PRIMARY KEY (tenant, operation, key_hash),
    CONSTRAINT idempotency_keys_lease CHECK ((status = 'processing') = (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT idempotency_keys_response CHECK ((status = 'processing') = (response_status IS NULL AND response_body IS NULL)),
    CONSTRAINT idempotency_keys_failed_is_error CHECK (status <> 'failed' OR response_status >= 400),
    CONSTRAINT idempotency_keys_success_is_2xx CHECK (status NOT IN ('completed', 'pending') OR response_status BETWEEN 200 AND 299),
    CONSTRAINT idempotency_keys_pending_has_resource CHECK (status <> 'pending' OR resource_id IS NOT NULL),
    CONSTRAINT idempotency_keys_expires_after_creation CHECK (expires_at > created_at)
);
COMMENT ON TABLE idempotency_keys IS 'One record per (tenant, operation, Idempotency-Key): reserved through the primary key before any effect, completed in the effect''s own transaction, replayed to retries, purged after expiry.';
COMMENT ON COLUMN idempotency_keys.tenant IS 'Scope: the authenticated tenant. The same key in two tenants never collides.';
COMMENT ON COLUMN idempotency_keys.operation IS 'Scope: the operation (create_order, create_payment). The same key on two routes never collides.';
COMMENT ON COLUMN idempotency_keys.key_hash IS 'SHA-256 of the Idempotency-Key header value; the key itself is not stored.';
COMMENT ON COLUMN idempotency_keys.fingerprint IS 'SHA-256 of the canonical JSON (sorted keys, no whitespace) of the validated request and the operation; a reuse with another fingerprint is rejected with 422.';
COMMENT ON COLUMN idempotency_keys.status IS 'processing: reserved, effect not committed (holds a lease); completed: final response stored; failed: definitive business error stored; pending: accepted, downstream outcome not known yet (202).';
COMMENT ON COLUMN idempotency_keys.response_status IS 'HTTP status of the stored response, replayed to retries; NULL while processing.';
COMMENT ON COLUMN idempotency_keys.response_body IS 'Exact JSON body of the stored response (text, not jsonb, so replays are byte-identical); NULL while processing.';
COMMENT ON COLUMN idempotency_keys.resource_id IS 'Id of the created order or payment, if any (gives the Location header of replays).';
COMMENT ON COLUMN idempotency_keys.lease_token IS 'Fencing token of the current holder of a processing record; completion and release compare it, so a holder whose lease was taken over cannot complete. NULL once final.';
COMMENT ON COLUMN idempotency_keys.lease_expires_at IS 'End of the processing lease; after it another request with the same key and payload takes the record over. NULL once final.';
COMMENT ON COLUMN idempotency_keys.created_at IS 'Reservation time (application clock).';
COMMENT ON COLUMN idempotency_keys.updated_at IS 'Last change (reservation, takeover, completion).';
COMMENT ON COLUMN idempotency_keys.expires_at IS 'End of retention (created_at + TTL, 24 h by default): afterwards the key counts as new and completed or failed records are purged. Pending records are kept until resolved.';

-- The purge reads expired final records and abandoned reservations.
CREATE INDEX idempotency_keys_expired_idx ON idempotency_keys (expires_at) WHERE status IN ('completed', 'failed');
CREATE INDEX idempotency_keys_processing_idx ON idempotency_keys (lease_expires_at) WHERE status = 'processing';
-- The trigger below finds the pending record of a payment.
CREATE INDEX idempotency_keys_pending_idx ON idempotency_keys (resource_id) WHERE status = 'pending';

-- A pending payment record becomes completed (and so, once expired, purgeable) when the downstream
-- charge settles the payment.
CREATE FUNCTION payments_resolve_idempotency() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status = 'pending' AND NEW.status <> 'pending' THEN
        UPDATE idempotency_keys
           SET status = 'completed', updated_at = now()
         WHERE resource_id = NEW.id
           AND tenant = NEW.tenant
           AND operation = 'create_payment'
           AND status = 'pending';
    END IF;
    RETURN NULL;
END;
$$;
COMMENT ON FUNCTION payments_resolve_idempotency() IS 'Row trigger function: when a payment leaves pending, its idempotency record leaves pending too (completed; the stored 202 response is still what retries get).';

CREATE TRIGGER payments_resolve_idempotency
    AFTER UPDATE OF status ON payments
    FOR EACH ROW EXECUTE FUNCTION payments_resolve_idempotency();
