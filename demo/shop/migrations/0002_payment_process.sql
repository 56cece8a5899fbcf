-- The payment process (processes crate, kind `payment`): POST /payments starts it, `producer
-- worker` runs it. Step reserve_order holds the order for one payment, record_capture marks it
-- paid; the payment row records its process, the provider's charge and why it failed.

ALTER TABLE demo.orders DROP CONSTRAINT IF EXISTS orders_status_check;
ALTER TABLE demo.orders ADD COLUMN IF NOT EXISTS reserved_by uuid REFERENCES demo.payments (id);
ALTER TABLE demo.orders ADD CONSTRAINT orders_status_check
    CHECK (status IN ('placed', 'reserved', 'paid', 'cancelled'));
ALTER TABLE demo.orders ADD CONSTRAINT orders_reserved_by_check
    CHECK ((status = 'placed' AND reserved_by IS NULL)
        OR (status = 'reserved' AND reserved_by IS NOT NULL)
        OR status IN ('paid', 'cancelled'));
COMMENT ON COLUMN demo.orders.status IS 'placed: accepted, payable; reserved: a payment process holds it (reserved_by) while it charges; paid: a payment was captured for it; cancelled: set by support or the customer (a payment charged meanwhile cannot be recorded and needs a refund).';
COMMENT ON COLUMN demo.orders.reserved_by IS 'The payment holding the order (status reserved) or that paid it (paid); NULL while placed. Set and cleared only by the payment process''s steps.';

ALTER TABLE demo.payments ADD COLUMN IF NOT EXISTS process_id uuid;
ALTER TABLE demo.payments ADD COLUMN IF NOT EXISTS charge_id text
    CHECK (charge_id IS NULL OR length(charge_id) BETWEEN 1 AND 200);
ALTER TABLE demo.payments ADD COLUMN IF NOT EXISTS failure_reason text
    CHECK (failure_reason IS NULL OR length(failure_reason) BETWEEN 1 AND 500);
ALTER TABLE demo.payments ADD CONSTRAINT payments_failure_only_when_failed
    CHECK (failure_reason IS NULL OR status = 'failed');
CREATE UNIQUE INDEX IF NOT EXISTS payments_process_id_key ON demo.payments (process_id);
COMMENT ON TABLE demo.payments IS 'Payments requested through POST /payments. The API records the request and starts a payment process ({{schema}}.processes, kind payment) in the same transaction; the worker (producer worker) charges at the provider and settles the row.';
COMMENT ON COLUMN demo.payments.status IS 'pending: requested, outcome not known yet (also while its process waits in manual_review); succeeded: captured (record_capture step); failed: declined, not payable, or refunded (compensation of reserve_order).';
COMMENT ON COLUMN demo.payments.process_id IS 'The payment process settling this payment ({{schema}}.processes.id, business key = this payment''s id); NULL for payments recorded before the process existed.';
COMMENT ON COLUMN demo.payments.charge_id IS 'The provider''s charge id once the charge was recorded (status succeeded).';
COMMENT ON COLUMN demo.payments.failure_reason IS 'Why the payment failed (status failed only): the decline, the order not payable, the refund after a cancelled order.';
