#!/usr/bin/env bash
# The whole system on the local PostgreSQL and RabbitMQ, without Docker: the producer API, two
# relays, the payment provider simulator, the payment process worker, the ledger and notifier consumers and a
# small load generator, as in docker-compose.yml. Ctrl-C or SIGTERM stops everything within 10 s.
#
#   scripts/up.sh            # runs until Ctrl-C
#   UP_SECONDS=30 scripts/up.sh   # runs 30 s, stops the load, waits until every payment is
#                                 # decided or in review (UP_SETTLE_SECONDS, default 120), prints
#                                 # what happened and fails if a payment is undecided or charged twice
#   PROVIDER_FAULTS=timeout_after_charge:10,decline:5 scripts/up.sh   # a misbehaving provider
#   UP_KEEP_DB=1 scripts/up.sh   # keep the demo database of the last run (default: a fresh one)
#   UP_BIN_DIR=target/debug scripts/up.sh   # binaries already built there, no release build
#   UP_METRICS_PORT=9101         # the relays', ledger's, worker's and notifier's metrics: this port and the next four
#   LEDGER_NAME=ledger           # the ledger consumer's name (its queues: NAME, NAME.dlq, NAME.retry.*)
#
#   PROVIDER_MODE=async scripts/up.sh   # charges confirmed later, by signed webhook
#
# Every PROVIDER_* variable of the environment (PROVIDER_FAULTS, PROVIDER_IDEMPOTENCY,
# PROVIDER_STATUS_QUERY, PROVIDER_SEED, PROVIDER_TIMEOUT_DELAY, PROVIDER_MODE, ...) reaches the
# payment provider simulator; see docs/payment-provider.md. Its webhooks go to the producer API's
# POST /webhooks/provider, both sides sharing PROVIDER_WEBHOOK_SECRET (random per run unless set).
# PAYMENT_CONFIRMATION_TIMEOUT (default 30s) is how long a pending charge waits for its webhook
# before the worker asks the provider; it reaches the payment worker from this environment.
set -euo pipefail
cd "$(dirname "$0")/.."

export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/outbox_demo}"
export AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
export OUTBOX_EXCHANGE="${OUTBOX_EXCHANGE:-outbox.events}"
LEDGER_NAME="${LEDGER_NAME:-ledger}"
API_ADDR="${API_ADDR:-127.0.0.1:8080}"
export PROVIDER_ADDR="${PROVIDER_ADDR:-127.0.0.1:8090}"
export PROVIDER_WEBHOOK_URL="${PROVIDER_WEBHOOK_URL:-http://$API_ADDR/webhooks/provider}"
export PROVIDER_WEBHOOK_SECRET="${PROVIDER_WEBHOOK_SECRET:-$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')}"
export PAYMENT_CONFIRMATION_TIMEOUT="${PAYMENT_CONFIRMATION_TIMEOUT:-30s}"
CONSOLE_ADDR="${CONSOLE_ADDR:-127.0.0.1:8070}"
LOG_DIR="${LOG_DIR:-target/up-logs}"
# The relays', the ledger's, the worker's and the notifier's metrics: this port and the next four.
METRICS_PORT="${UP_METRICS_PORT:-9101}"

# Stopping. Bash runs a trap only once the foreground command it waits for has ended, so every
# long wait below (the build, the run) is a background job and a `wait`, which a signal ends at
# once. Each child gets SIGTERM; whatever still runs after UP_STOP_GRACE seconds (default 8) gets
# SIGKILL, so the script is gone within 10 s of the signal.
pids=()
stopping=""
cleanup() {
    [[ -n "$stopping" ]] && return
    stopping=1
    trap - INT TERM
    ((${#pids[@]})) || return 0
    echo "stopping"
    # A child's own children (the load generator's curl and sleep) go too, not orphaned.
    local kids
    for p in "${pids[@]}"; do
        kids=$(pgrep -P "$p" 2>/dev/null || true)
        kill -TERM "$p" 2>/dev/null || true
        # shellcheck disable=SC2086 # one pid a word
        if [[ -n "$kids" ]]; then kill -TERM $kids 2>/dev/null || true; fi
    done
    local deadline=$((SECONDS + ${UP_STOP_GRACE:-8}))
    for p in "${pids[@]}"; do
        while kill -0 "$p" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    done
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
# Runs "$@" as a job the traps can stop, and waits for it (its exit status is this one's).
job() {
    "$@" &
    pids+=($!)
    wait $!
}

job scripts/services.sh
# UP_BIN_DIR=target/debug uses binaries already built there instead of building release ones
# (how the stop time was measured without a release build).
if [[ -n "${UP_BIN_DIR:-}" ]]; then
    BIN="$UP_BIN_DIR"
else
    echo "building release binaries"
    job cargo build --release --bins -q
    BIN=target/release
fi
pids=()
mkdir -p "$LOG_DIR"

# A fresh demo database every run (UP_KEEP_DB=1 keeps the last run's): the example's state is
# disposable, and a database left by an older checkout may hold migrations this one has changed.
db_name="${DATABASE_URL##*/}"
if [[ -z "${UP_KEEP_DB:-}" ]]; then
    psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS $db_name WITH (FORCE)"
fi
psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db_name'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE $db_name"
"$BIN/producer" migrate   # the product schema (outbox) and the example application's (demo)

API_KEY="$("$BIN/producer" api-key create --tenant demo)"
CONSOLE_TOKEN="$("$BIN/console" user create --name demo-admin --role admin --replace | tail -n 1)"
# The console links a step's charge reference to the provider simulator's record of it, and its
# charts to Grafana's panels when GRAFANA_URL names a Grafana (this script runs none).
console_links=(CONSOLE_REMOTE_URL="${CONSOLE_REMOTE_URL:-http://$PROVIDER_ADDR/charges/{ref\}}")
grafana="${CONSOLE_GRAFANA_URL:-${GRAFANA_URL:-}}"
[ -n "$grafana" ] && console_links+=(CONSOLE_GRAFANA_URL="$grafana")
env "${console_links[@]}" CONSOLE_ADDR="$CONSOLE_ADDR" CONSOLE_CONSUMERS="$LEDGER_NAME" "$BIN/console" serve >"$LOG_DIR/console.log" 2>&1 & pids+=($!)
LISTEN_ADDR="$API_ADDR" "$BIN/producer" >"$LOG_DIR/producer.log" 2>&1 & pids+=($!)
METRICS_ADDR=127.0.0.1:$((METRICS_PORT + 0)) "$BIN/relay" >"$LOG_DIR/relay-1.log" 2>&1 & pids+=($!)
METRICS_ADDR=127.0.0.1:$((METRICS_PORT + 1)) "$BIN/relay" >"$LOG_DIR/relay-2.log" 2>&1 & pids+=($!)
METRICS_ADDR=127.0.0.1:$((METRICS_PORT + 2)) "$BIN/producer" ledger --name "$LEDGER_NAME" --bind "payment.*" --bind "order.*" >"$LOG_DIR/consumer-ledger.log" 2>&1 & pids+=($!)
# The payment provider simulator (schema provider; PROVIDER_* come through from the environment).
"$BIN/payment-provider" >"$LOG_DIR/payment-provider.log" 2>&1 & pids+=($!)
# The payment process worker: charges at the provider, waits for pending charges' webhooks (at
# most PAYMENT_CONFIRMATION_TIMEOUT, then asks the provider), records captures, compensates declines.
PROVIDER_URL="http://$PROVIDER_ADDR" METRICS_ADDR=127.0.0.1:$((METRICS_PORT + 3)) "$BIN/producer" worker >"$LOG_DIR/payment-worker.log" 2>&1 & pids+=($!)
# The notifier: a consumer that calls a remote (the simulator's POST /notifications) for every
# payment.captured, through the shared "notifications" circuit (docs/consumer.md).
PROVIDER_URL="http://$PROVIDER_ADDR" METRICS_ADDR=127.0.0.1:$((METRICS_PORT + 4)) "$BIN/producer" notifier --name notifier >"$LOG_DIR/consumer-notifier.log" 2>&1 & pids+=($!)

for _ in $(seq 1 100); do curl -fsS "http://$API_ADDR/readyz" >/dev/null 2>&1 && break; sleep 0.2; done
for _ in $(seq 1 100); do curl -fsS "http://$PROVIDER_ADDR/readyz" >/dev/null 2>&1 && break; sleep 0.2; done
cat <<EOT
running:
  producer API   http://$API_ADDR  (API key: $API_KEY)
  relay metrics  http://127.0.0.1:$((METRICS_PORT + 0))/metrics  http://127.0.0.1:$((METRICS_PORT + 1))/metrics
  ledger         http://127.0.0.1:$((METRICS_PORT + 2))/metrics (producer ledger, the example consumer: applies payment.captured, acks the other events)
  provider       http://$PROVIDER_ADDR  payment provider simulator (mode: ${PROVIDER_MODE:-sync}; faults: ${PROVIDER_FAULTS:-none}; charges: /admin/charges; webhooks: /admin/events -> $PROVIDER_WEBHOOK_URL)
  console        http://$CONSOLE_ADDR  (log in with the admin token: $CONSOLE_TOKEN; docs/console.md)
  worker         http://127.0.0.1:$((METRICS_PORT + 3))/metrics (producer worker: the payment processes)
  notifier       http://127.0.0.1:$((METRICS_PORT + 4))/metrics (producer notifier: posts a notification per payment.captured; outage drill: POST /admin/outage {"outage":"503:1"} on the provider)
  logs           $LOG_DIR/
load: deploy/loadgen.sh places an order and pays it every 200 ms (with replays, conflicts, mismatches)
EOT

API_KEY="$API_KEY" API_ADDR="$API_ADDR" deploy/loadgen.sh >"$LOG_DIR/loadgen.log" 2>&1 & loadgen=$!; pids+=($loadgen)

# Payments not decided (succeeded or failed) with no open review: their process is not in
# manual_review and reconciliation has no open case for them. And references the provider charged
# more than once (more than one charge that took money).
undecided_sql="SELECT count(*) FROM demo.payments p
    LEFT JOIN outbox.processes pr ON pr.kind = 'payment' AND pr.business_key = p.id::text AND pr.revision = 0
    WHERE p.status = 'pending' AND pr.status IS DISTINCT FROM 'manual_review'
      AND NOT EXISTS (SELECT 1 FROM demo.reconciliation_cases c WHERE c.payment_id = p.id AND c.resolved_at IS NULL)"
charged_twice_sql="SELECT count(*) FROM (SELECT reference FROM provider.charges
    WHERE status IN ('succeeded', 'refunded') GROUP BY reference HAVING count(*) > 1) t"

if [[ -n "${UP_SECONDS:-}" ]]; then
    job sleep "$UP_SECONDS"
    echo "--- after ${UP_SECONDS}s: load stopped, waiting up to ${UP_SETTLE_SECONDS:-120}s for every payment to be decided or in review"
    kill -TERM "$loadgen" 2>/dev/null || true
    settle_until=$((SECONDS + ${UP_SETTLE_SECONDS:-120}))
    while (( $(psql "$DATABASE_URL" -tAc "$undecided_sql") > 0 )) && ((SECONDS < settle_until)); do
        job sleep 2
    done
    psql "$DATABASE_URL" -c "SELECT (SELECT count(*) FROM demo.orders) AS orders, (SELECT count(*) FROM demo.payments) AS payments,
        (SELECT count(*) FROM demo.payments WHERE status = 'succeeded') AS succeeded,
        (SELECT count(*) FROM demo.payments WHERE status = 'failed') AS failed,
        (SELECT count(*) FROM outbox.processes WHERE kind = 'payment' AND status = 'manual_review') AS in_review,
        (SELECT count(*) FROM demo.reconciliation_cases WHERE resolved_at IS NULL) AS open_cases,
        (SELECT count(*) FROM outbox.messages WHERE state = 'pending') AS outbox_pending,
        (SELECT coalesce(sum(updates), 0) FROM demo.ledger_balances) AS ledger_updates"
    undecided=$(psql "$DATABASE_URL" -tAc "$undecided_sql")
    charged_twice=$(psql "$DATABASE_URL" -tAc "$charged_twice_sql")
    echo "undecided without review: $undecided; charged twice: $charged_twice"
    if ((undecided > 0 || charged_twice > 0)); then
        echo "FAILED: every payment must be decided or in review, and none charged twice"
        exit 1
    fi
else
    wait
fi
