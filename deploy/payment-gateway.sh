#!/usr/bin/env bash
# Stand-in for the downstream payment processor of the demo (docker-compose.yml service
# payment-gateway; needs bash and psql only, runs in the postgres image).
#
# Every GATEWAY_INTERVAL_SECONDS it settles the pending payments the API accepted: most succeed,
# GATEWAY_FAIL_PERCENT fail. In the same transaction it writes one `payment.captured` event per
# succeeded payment straight into the outbox with a plain INSERT: the language-neutral outbox
# contract, no Rust involved. The relays publish those, and the ledger consumer applies them
# (payload {"account", "amount"}), so its processed count and end-to-end latency show on the
# dashboards.
#
# GATEWAY_POISON_PERCENT (default 0) makes that share of the events unreadable for the ledger
# (amount not a number): they are dead-lettered, to exercise the DLQ panels, the
# ConsumerDeadLetterRateHigh alert and `consumer dlq list`.
#
# Environment: DATABASE_URL (required), GATEWAY_INTERVAL_SECONDS (default 1),
# GATEWAY_FAIL_PERCENT (default 5), GATEWAY_POISON_PERCENT (default 0), GATEWAY_SECONDS (default
# 0: until stopped).
set -euo pipefail

: "${DATABASE_URL:?DATABASE_URL is required}"
interval="${GATEWAY_INTERVAL_SECONDS:-1}"
fail="${GATEWAY_FAIL_PERCENT:-5}"
poison="${GATEWAY_POISON_PERCENT:-0}"
seconds="${GATEWAY_SECONDS:-0}"
for v in "$interval" "$fail" "$poison" "$seconds"; do
    [[ "$v" =~ ^[0-9]+$ ]] || { echo "payment-gateway: not a whole number: $v" >&2; exit 2; }
done

sql="
WITH settled AS (
    UPDATE demo.payments p
       SET status = CASE WHEN random() * 100 < $fail THEN 'failed' ELSE 'succeeded' END,
           updated_at = clock_timestamp()
     WHERE p.id IN (SELECT id FROM demo.payments WHERE status = 'pending'
                    ORDER BY created_at LIMIT 1000 FOR UPDATE SKIP LOCKED)
 RETURNING p.id, p.tenant, p.order_id, p.amount, p.currency, p.status
), paid AS (
    UPDATE demo.orders o SET status = 'paid'
      FROM settled s
     WHERE o.id = s.order_id AND s.status = 'succeeded' AND o.status = 'placed'
)
INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, headers)
SELECT 'payment', s.id::text, 'payment.captured',
       jsonb_build_object(
           'payment_id', s.id,
           'order_id', s.order_id,
           'account', s.tenant || ':' || s.currency,
           'amount', CASE WHEN random() * 100 < $poison THEN to_jsonb('not-a-number'::text)
                          ELSE to_jsonb(s.amount) END,
           'currency', s.currency),
       jsonb_build_object('tenant', s.tenant)
  FROM settled s
 WHERE s.status = 'succeeded';
"

echo "payment-gateway: settling pending payments every ${interval}s (${fail}% fail, ${poison}% poison events)" >&2
started=$SECONDS
while ((seconds == 0 || SECONDS - started < seconds)); do
    psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 -c "$sql" >/dev/null \
        || { echo "payment-gateway: settle failed, retrying" >&2; sleep 5; }
    sleep "$interval"
done
