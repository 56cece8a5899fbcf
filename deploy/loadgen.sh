#!/usr/bin/env bash
# Demo load for the producer API: places an order and pays it every LOADGEN_INTERVAL_MS, each
# request with its own Idempotency-Key, so the dashboards show the whole flow (API -> outbox ->
# relays -> RabbitMQ -> consumer) and every idempotency outcome:
#
#   new        every request the first time
#   replayed   every LOADGEN_REPLAY_EVERY-th request is sent again with the same key and body
#   conflict   every LOADGEN_CONFLICT_EVERY-th payment is sent twice at the same time (the second
#              may find the first still processing: 409)
#   mismatch   every LOADGEN_MISMATCH_EVERY-th order key is reused with another body (422)
#
# Used by docker-compose.yml (service loadgen) and scripts/up.sh. Needs bash and curl only.
#
# Environment:
#   API_ADDR                 host:port of the producer API (default 127.0.0.1:8080)
#   API_KEY                  bearer API key; when empty, one is created for LOADGEN_TENANT with
#                            `producer api-key create` (needs the producer binary and DATABASE_URL)
#   DATABASE_URL             only to create that key
#   LOADGEN_TENANT           tenant of a created key (default demo)
#   LOADGEN_INTERVAL_MS      pause between two orders, in ms (default 200)
#   LOADGEN_REPLAY_EVERY     replay every n-th request (default 5; 0: never)
#   LOADGEN_CONFLICT_EVERY   race two copies of every n-th payment (default 50; 0: never)
#   LOADGEN_MISMATCH_EVERY   reuse every n-th order key with another body (default 100; 0: never)
#   LOADGEN_SECONDS          stop after this many seconds (default 0: until stopped)
set -uo pipefail # no -e: a failed request is counted, not fatal

api="http://${API_ADDR:-127.0.0.1:8080}"
interval_ms="${LOADGEN_INTERVAL_MS:-200}"
replay_every="${LOADGEN_REPLAY_EVERY:-5}"
conflict_every="${LOADGEN_CONFLICT_EVERY:-50}"
mismatch_every="${LOADGEN_MISMATCH_EVERY:-100}"
seconds="${LOADGEN_SECONDS:-0}"
tenant="${LOADGEN_TENANT:-demo}"

log() { printf '%s loadgen: %s\n' "$(date -u +%FT%TZ)" "$*" >&2; }

for _ in $(seq 1 150); do
    curl -fsS -o /dev/null --max-time 2 "$api/readyz" && break
    sleep 1
done

key="${API_KEY:-}"
if [[ -z "$key" ]]; then
    : "${DATABASE_URL:?API_KEY is empty: DATABASE_URL is needed to create a key}"
    key="$(producer api-key create --tenant "$tenant")" || {
        log "cannot create an API key"
        exit 1
    }
    log "created an API key for tenant $tenant"
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
run_id="$(date +%s)-$$"

# post PATH IDEMPOTENCY_KEY BODY OUT_FILE: prints the HTTP status (000 when unreachable).
post() {
    curl -sS -o "$4" -w '%{http_code}' --max-time 10 -X POST "$api$1" \
        -H "Authorization: Bearer $key" \
        -H "Idempotency-Key: $2" \
        -H 'Content-Type: application/json' \
        --data "$3" 2>/dev/null || true
}

# The first "id" of a JSON response body.
first_id() { grep -o '"id":"[0-9a-fA-F-]\{36\}"' "$1" | head -n1 | cut -d'"' -f4; }

declare -A statuses=()
count() { statuses[$1]=$((${statuses[$1]:-0} + 1)); }
report() {
    local line="" s
    for s in "${!statuses[@]}"; do line+=" $s=${statuses[$s]}"; done
    log "requests by status:${line:- none}"
}

started=$SECONDS
n=0
last_report=$SECONDS
log "posting to $api: an order and its payment every ${interval_ms} ms"
while ((seconds == 0 || SECONDS - started < seconds)); do
    n=$((n + 1))
    qty=$((RANDOM % 5 + 1))
    price=$((RANDOM % 9000 + 100))
    total=$((qty * price))
    order_key="order-$run_id-$n"
    order_body="{\"customer_id\":\"cust-$((RANDOM % 500))\",\"currency\":\"EUR\",\"items\":[{\"sku\":\"sku-$((RANDOM % 50))\",\"quantity\":$qty,\"unit_price\":$price}]}"

    status="$(post /orders "$order_key" "$order_body" "$tmp/order")"
    count "order:$status"
    order_id="$(first_id "$tmp/order")"
    if ((replay_every > 0 && n % replay_every == 0)); then
        count "order-replay:$(post /orders "$order_key" "$order_body" "$tmp/replay")"
    fi
    if ((mismatch_every > 0 && n % mismatch_every == 0)); then
        other="{\"customer_id\":\"cust-x\",\"currency\":\"EUR\",\"items\":[{\"sku\":\"sku-x\",\"quantity\":1,\"unit_price\":1}]}"
        count "order-mismatch:$(post /orders "$order_key" "$other" "$tmp/mismatch")"
    fi

    if [[ -n "$order_id" ]]; then
        pay_key="payment-$run_id-$n"
        pay_body="{\"order_id\":\"$order_id\",\"amount\":$total,\"currency\":\"EUR\"}"
        if ((conflict_every > 0 && n % conflict_every == 0)); then
            post /payments "$pay_key" "$pay_body" "$tmp/race1" >"$tmp/race1.status" &
            post /payments "$pay_key" "$pay_body" "$tmp/race2" >"$tmp/race2.status" &
            wait
            count "payment-race:$(cat "$tmp/race1.status")"
            count "payment-race:$(cat "$tmp/race2.status")"
        else
            count "payment:$(post /payments "$pay_key" "$pay_body" "$tmp/payment")"
            if ((replay_every > 0 && n % replay_every == 0)); then
                count "payment-replay:$(post /payments "$pay_key" "$pay_body" "$tmp/replay")"
            fi
        fi
    fi

    if ((SECONDS - last_report >= 30)); then
        report
        last_report=$SECONDS
    fi
    sleep "$(printf '%d.%03d' $((interval_ms / 1000)) $((interval_ms % 1000)))"
done
report
