#!/usr/bin/env bash
# The console's process list over 1,000,000 processes (issue 23, "Measures to report"): creates a
# scratch database with the product's schema, bulk-inserts N processes (default 1,000,000) with
# three steps each and their history (the triggers write it), then runs EXPLAIN ANALYZE of the
# exact statements processes::find builds (processes/src/find.rs): the first page, a deep page,
# a status page, the counts by status, a filtered total, and the search by each key. Drops the
# database at the end, also on error or Ctrl-C.
#
#   scripts/process-list-1m.sh            # 1,000,000 processes
#   N=100000 scripts/process-list-1m.sh   # fewer
#
# Needs psql and a PostgreSQL the user may create databases on (PGHOST, PGPORT, PGUSER; default
# 127.0.0.1:5432, postgres).
set -euo pipefail
export PGHOST="${PGHOST:-127.0.0.1}" PGPORT="${PGPORT:-5432}" PGUSER="${PGUSER:-postgres}"
N="${N:-1000000}"
DB="process_list_1m_$$"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cleanup() { psql -qX -d postgres -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true; }
trap cleanup EXIT INT TERM

psql -qX -d postgres -c "CREATE DATABASE $DB" >/dev/null
q() { psql -qX -v ON_ERROR_STOP=1 -d "$DB" "$@"; }
q -c 'CREATE SCHEMA "outbox"'
for m in "$ROOT"/migrations/[0-9]*.sql; do
    sed 's/{{schema}}/"outbox"/g' "$m" | q >/dev/null
done

echo "inserting $N processes (3 steps each) ..."
start=$(date +%s)
q <<SQL
-- UUIDv7-like ids in creation order: 48 bits of milliseconds, version 7, random rest.
CREATE TEMP TABLE g AS
SELECT g, ts,
       (lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '7' || substr(md5(g::text), 1, 3)
        || '8' || substr(md5(g::text), 4, 15))::uuid AS id,
       CASE WHEN g % 100 < 5 THEN 'manual_review' WHEN g % 100 < 10 THEN 'pending'
            WHEN g % 100 < 13 THEN 'waiting' ELSE 'succeeded' END AS status
FROM (SELECT g, now() - interval '30 days' + g * interval '2 seconds' AS ts
      FROM generate_series(1, $N) g) s;
INSERT INTO outbox.processes (id, kind, definition_version, business_key, status, last_reason, input,
                              input_redacted, created_at, updated_at, finished_at)
SELECT id, 'payment', 2, 'pay-' || g, status, 'bulk', jsonb_build_object('order_id', 'ord-' || g, 'payment_id', 'pay-' || g, 'card', '4111'),
       jsonb_build_object('order_id', 'ord-' || g, 'payment_id', 'pay-' || g, 'card', '[redacted]'), ts, ts,
       CASE WHEN status = 'succeeded' THEN ts END
FROM g;
INSERT INTO outbox.process_steps (process_id, seq, name, role, execution, remote, status, operation_id,
                                  max_attempts, last_reason, error_class, remote_ref, finished_at, result_ref)
SELECT id, s.seq, s.name, 'forward', s.execution, s.remote,
       CASE WHEN g.status = 'succeeded' THEN 'succeeded'
            WHEN g.status = 'manual_review' AND s.name = 'charge' THEN 'manual_review' ELSE 'pending' END,
       md5(id::text || s.name)::uuid, 5, 'bulk',
       CASE WHEN g.status = 'manual_review' AND s.name = 'charge' THEN (ARRAY['unknown', 'transient', 'permanent'])[1 + g % 3] END,
       CASE WHEN s.name = 'charge' AND g.status = 'succeeded' THEN 'ch_' || g END,
       CASE WHEN g.status = 'succeeded' THEN ts END,
       CASE WHEN g.status = 'succeeded' AND s.name <> 'charge' THEN 'row ' || g END
FROM g CROSS JOIN (VALUES (0, 'reserve_order', 'local', NULL), (1, 'charge', 'external', 'honours_key'),
                          (2, 'record_capture', 'local', NULL)) AS s(seq, name, execution, remote);
VACUUM ANALYZE outbox.processes;
VACUUM ANALYZE outbox.process_steps;
VACUUM ANALYZE outbox.process_history;
SQL
echo "inserted in $(( $(date +%s) - start )) s"

# The exact statements of processes/src/find.rs, with the values a client would send.
COLS="p.id, p.kind, p.definition_version, p.business_key, p.revision, p.revision_of, p.status, p.paused, p.attempt, p.last_reason, p.last_actor, p.created_at, p.updated_at, p.finished_at, p.deadline_at, p.lease_owner, p.lease_until, p.row_version"
MID=$(q -tA -c "SELECT id FROM outbox.processes ORDER BY id DESC OFFSET $((N / 2)) LIMIT 1")
DEEP=$(q -tA -c "SELECT id FROM outbox.processes ORDER BY id DESC OFFSET $((N - 100)) LIMIT 1")
K=$((N / 3))
OP=$(q -tA -c "SELECT operation_id FROM outbox.process_steps s JOIN outbox.processes p ON p.id = s.process_id WHERE p.business_key = 'pay-$K' AND s.name = 'charge'")
PID=$(q -tA -c "SELECT id FROM outbox.processes WHERE business_key = 'pay-$K'")
search() {
    local s="$1" uuid_part=""
    if [[ "$s" =~ ^[0-9a-f-]{36}$ ]]; then
        uuid_part="SELECT '$s'::uuid::uuid UNION SELECT s.process_id FROM \"outbox\".process_steps s WHERE s.operation_id = '$s' UNION "
    fi
    echo " AND p.id IN (${uuid_part}SELECT b.id FROM \"outbox\".processes b WHERE b.business_key = '$s' UNION SELECT r.process_id FROM \"outbox\".process_steps r WHERE r.remote_ref = '$s' UNION SELECT i.id FROM \"outbox\".processes i WHERE i.input_redacted @? '\$.* ? (@ == \"$s\")'::jsonpath)"
}
REVIEW_EXISTS=" AND EXISTS (SELECT 1 FROM \"outbox\".process_steps s WHERE s.process_id = p.id AND s.status IN ('running', 'retryable', 'failed', 'manual_review') AND s.name = 'charge' AND s.error_class = 'unknown' AND s.remote = 'honours_key')"
declare -a NAMES SQLS
add() { NAMES+=("$1"); SQLS+=("$2"); }
add "first page (50)"                "SELECT $COLS FROM \"outbox\".processes p WHERE true ORDER BY p.id DESC LIMIT 51"
add "middle page (after row $((N / 2)))"  "SELECT $COLS FROM \"outbox\".processes p WHERE true AND p.id < '$MID' ORDER BY p.id DESC LIMIT 51"
add "last page (after row $((N - 100)))"  "SELECT $COLS FROM \"outbox\".processes p WHERE true AND p.id < '$DEEP' ORDER BY p.id DESC LIMIT 51"
add "counts by status (the unfiltered total)" "SELECT status, count(*) AS n FROM \"outbox\".processes GROUP BY status"
add "status page: manual_review, deep" "SELECT $COLS FROM \"outbox\".processes p WHERE true AND p.status = 'manual_review' AND p.id < '$MID' ORDER BY p.id DESC LIMIT 51"
add "filter page: charge unknown on honours_key" "SELECT $COLS FROM \"outbox\".processes p WHERE true AND p.status = 'manual_review'$REVIEW_EXISTS ORDER BY p.id DESC LIMIT 51"
add "filter total: charge unknown on honours_key" "SELECT count(*) FROM \"outbox\".processes p WHERE true AND p.status = 'manual_review'$REVIEW_EXISTS"
add "filter total: error_class=unknown (no status)" "SELECT count(*) FROM \"outbox\".processes p WHERE true AND EXISTS (SELECT 1 FROM \"outbox\".process_steps s WHERE s.process_id = p.id AND s.status IN ('running', 'retryable', 'failed', 'manual_review') AND s.error_class = 'unknown')"
add "in review longer than 1h (total)" "SELECT count(*) FROM \"outbox\".processes p WHERE true AND p.status = 'manual_review' AND (SELECT max(h.at) FROM \"outbox\".process_history h WHERE h.process_id = p.id AND h.step_seq IS NULL AND h.to_status = 'manual_review') <= now() - make_interval(secs => 3600)"
for key in "pay-$K" "ord-$K" "ch_$K" "$PID" "$OP"; do
    add "search $key (page)"  "SELECT $COLS FROM \"outbox\".processes p WHERE true$(search "$key") ORDER BY p.id DESC LIMIT 51"
    add "search $key (total)" "SELECT count(*) FROM \"outbox\".processes p WHERE true$(search "$key")"
done

printf '\n%-48s %10s  %s\n' "statement ($N processes)" "ms" "plan (top node)"
for i in "${!NAMES[@]}"; do
    q -c "SELECT 1" >/dev/null
    # Twice: the first run warms the cache; the second is reported.
    q -tA -c "EXPLAIN (ANALYZE, FORMAT JSON) ${SQLS[$i]}" >/dev/null
    plan=$(q -tA -c "EXPLAIN (ANALYZE, FORMAT JSON) ${SQLS[$i]}")
    ms=$(echo "$plan" | python3 -c 'import json,sys; p=json.load(sys.stdin)[0]; print("%.2f" % (p["Execution Time"]+p["Planning Time"]))')
    node=$(echo "$plan" | python3 -c '
import json,sys
def walk(n, d=0):
    out = ["%s%s%s" % ("  "*d, n["Node Type"], (" on " + n["Index Name"]) if "Index Name" in n else (" on " + n["Relation Name"]) if "Relation Name" in n else "")]
    for c in n.get("Plans", []): out += walk(c, d+1)
    return out
print(" | ".join(l.strip() for l in walk(json.load(sys.stdin)[0]["Plan"])[:6]))')
    printf '%-48s %10s  %s\n' "${NAMES[$i]}" "$ms" "$node"
done
