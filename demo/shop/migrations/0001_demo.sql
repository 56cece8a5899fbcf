-- The example application's tables (orders, payments, API keys, the ledger), in its own schema
-- `demo`, beside the product (schema {{schema}}). The product never creates them.
--
-- Upgrade from the releases that kept them in `public`: tables there that carry the comment of that
-- release are moved here as they are (rows, indexes, constraints); then the CREATE ... IF NOT
-- EXISTS below find them.

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['api_keys', 'orders', 'order_items', 'payments', 'ledger_balances'] LOOP
        IF to_regclass('public.' || t) IS NOT NULL
           AND obj_description(('public.' || t)::regclass, 'pg_class') LIKE (CASE t
               WHEN 'api_keys' THEN 'Bearer API keys of the producer HTTP API%'
               WHEN 'orders' THEN 'Orders placed through POST /orders%'
               WHEN 'order_items' THEN 'Lines of an order%'
               WHEN 'payments' THEN 'Payments requested through POST /payments%'
               WHEN 'ledger_balances' THEN 'Effect of the built-in example handler%'
           END) THEN
            EXECUTE format('ALTER TABLE public.%I SET SCHEMA demo', t);
        END IF;
    END LOOP;
END
$$;

CREATE TABLE IF NOT EXISTS demo.api_keys (
    id          uuid        PRIMARY KEY,
    tenant      text        NOT NULL CHECK (tenant ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'),
    key_hash    bytea       NOT NULL CHECK (octet_length(key_hash) = 32),
    key_prefix  text        NOT NULL CHECK (length(key_prefix) BETWEEN 1 AND 16),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,
    CONSTRAINT api_keys_key_hash_key UNIQUE (key_hash)
);
COMMENT ON TABLE demo.api_keys IS 'Bearer API keys of the producer HTTP API; each key belongs to one tenant. Only a hash of the key is stored.';
COMMENT ON COLUMN demo.api_keys.id IS 'Key id, for operators (revocation, audit).';
COMMENT ON COLUMN demo.api_keys.tenant IS 'Tenant the key authenticates as; scopes every resource and idempotency key.';
COMMENT ON COLUMN demo.api_keys.key_hash IS 'SHA-256 of the full key. Keys are 256-bit random values, so an unsalted hash is safe; the key itself is shown once at creation.';
COMMENT ON COLUMN demo.api_keys.key_prefix IS 'First characters of the key (not secret), so operators can tell keys apart.';
COMMENT ON COLUMN demo.api_keys.created_at IS 'Creation time.';
COMMENT ON COLUMN demo.api_keys.revoked_at IS 'Set when the key was revoked; a revoked key no longer authenticates.';

CREATE TABLE IF NOT EXISTS demo.orders (
    id            uuid        PRIMARY KEY,
    tenant        text        NOT NULL CHECK (tenant <> ''),
    customer_id   text        NOT NULL CHECK (length(customer_id) BETWEEN 1 AND 255),
    currency      text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    total_amount  bigint      NOT NULL CHECK (total_amount > 0),
    status        text        NOT NULL DEFAULT 'placed' CHECK (status IN ('placed', 'paid', 'cancelled')),
    created_at    timestamptz NOT NULL
);
COMMENT ON TABLE demo.orders IS 'Orders placed through POST /orders; each insert is accompanied by an order.placed outbox event in the same transaction.';
COMMENT ON COLUMN demo.orders.id IS 'Order id (UUIDv7), the aggregate_id of its events.';
COMMENT ON COLUMN demo.orders.tenant IS 'Owning tenant; other tenants never see the order.';
COMMENT ON COLUMN demo.orders.customer_id IS 'Caller-supplied customer reference.';
COMMENT ON COLUMN demo.orders.currency IS 'ISO 4217 style code: three upper-case letters.';
COMMENT ON COLUMN demo.orders.total_amount IS 'Sum of the line totals in minor units, computed with checked arithmetic.';
COMMENT ON COLUMN demo.orders.status IS 'placed: accepted; paid and cancelled are set downstream.';
COMMENT ON COLUMN demo.orders.created_at IS 'Acceptance time (application clock).';

CREATE TABLE IF NOT EXISTS demo.order_items (
    order_id    uuid    NOT NULL REFERENCES demo.orders (id) ON DELETE CASCADE,
    line_no     integer NOT NULL CHECK (line_no >= 1),
    sku         text    NOT NULL CHECK (length(sku) BETWEEN 1 AND 64),
    quantity    bigint  NOT NULL CHECK (quantity > 0),
    unit_price  bigint  NOT NULL CHECK (unit_price > 0),
    line_total  bigint  NOT NULL CHECK (line_total > 0),
    PRIMARY KEY (order_id, line_no)
);
COMMENT ON TABLE demo.order_items IS 'Lines of an order, in the order the client sent them.';
COMMENT ON COLUMN demo.order_items.order_id IS 'The order this line belongs to.';
COMMENT ON COLUMN demo.order_items.line_no IS 'Position of the line in the request, from 1.';
COMMENT ON COLUMN demo.order_items.sku IS 'Stock keeping unit as sent by the client.';
COMMENT ON COLUMN demo.order_items.quantity IS 'Number of units, > 0.';
COMMENT ON COLUMN demo.order_items.unit_price IS 'Price of one unit in minor units, > 0.';
COMMENT ON COLUMN demo.order_items.line_total IS 'quantity * unit_price in minor units (checked).';

CREATE TABLE IF NOT EXISTS demo.payments (
    id          uuid        PRIMARY KEY,
    tenant      text        NOT NULL CHECK (tenant <> ''),
    order_id    uuid        NOT NULL REFERENCES demo.orders (id),
    amount      bigint      NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status      text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'succeeded', 'failed')),
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS payments_order_id_idx ON demo.payments (order_id);
COMMENT ON TABLE demo.payments IS 'Payments requested through POST /payments. The charge happens downstream (payment.requested event through the outbox); the API only records the request.';
COMMENT ON COLUMN demo.payments.id IS 'Payment id (UUIDv7), the aggregate_id of its events.';
COMMENT ON COLUMN demo.payments.tenant IS 'Owning tenant; equals the tenant of the order.';
COMMENT ON COLUMN demo.payments.order_id IS 'The order being paid.';
COMMENT ON COLUMN demo.payments.amount IS 'Amount in minor units, > 0.';
COMMENT ON COLUMN demo.payments.currency IS 'Three upper-case letters; equals the order currency.';
COMMENT ON COLUMN demo.payments.status IS 'pending: requested, outcome not known yet; succeeded or failed: set by the downstream charge.';
COMMENT ON COLUMN demo.payments.created_at IS 'Request time (application clock).';
COMMENT ON COLUMN demo.payments.updated_at IS 'Last status change.';

CREATE TABLE IF NOT EXISTS demo.ledger_balances (
    account text   PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0,
    updates bigint NOT NULL DEFAULT 0
);

COMMENT ON TABLE demo.ledger_balances IS 'Effect of the built-in example handler "ledger" (payment.captured events). Adding to a balance is deliberately not idempotent: deduplication keeps it right.';
COMMENT ON COLUMN demo.ledger_balances.account IS 'Account named by the event payload field "account".';
COMMENT ON COLUMN demo.ledger_balances.balance IS 'Sum of the "amount" fields of every payment.captured event applied to the account.';
COMMENT ON COLUMN demo.ledger_balances.updates IS 'Number of events applied to the account: equals the number of distinct events when every effect was applied exactly once.';

-- A pending payment's idempotency record becomes completed (and so, once expired, purgeable) when
-- the downstream charge settles the payment.
CREATE FUNCTION demo.payments_resolve_idempotency() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status = 'pending' AND NEW.status <> 'pending' THEN
        UPDATE {{schema}}.idempotency_keys
           SET status = 'completed', updated_at = now()
         WHERE resource_id = NEW.id
           AND scope = NEW.tenant
           AND operation = 'create_payment'
           AND status = 'pending';
    END IF;
    RETURN NULL;
END;
$$;
COMMENT ON FUNCTION demo.payments_resolve_idempotency() IS 'Row trigger function: when a payment leaves pending, its idempotency record leaves pending too (completed; the stored 202 response is still what retries get).';

CREATE TRIGGER payments_resolve_idempotency
    AFTER UPDATE OF status ON demo.payments
    FOR EACH ROW EXECUTE FUNCTION demo.payments_resolve_idempotency();
