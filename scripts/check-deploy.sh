#!/usr/bin/env bash
# Static checks of the deployment files (no Docker engine needed): Prometheus config, alert
# rules and their unit tests, Grafana dashboards and provisioning, docker-compose.yml against the
# binaries, Dockerfile, helper scripts, and the runbook in docs/operations.md.
#
#   scripts/check-deploy.sh
#
# Needs promtool (Debian package `prometheus`), docker-compose (Debian package `docker-compose`,
# which also brings python3-yaml) and python3; .ci/run installs them. Uses the binaries'
# `--help` at target/debug/{relay,consumer,producer}, building them only when missing.
# Prints every check; exits non-zero when any fails.
set -uo pipefail
cd "$(dirname "$0")/.."

failures=0
ok() { printf 'ok    %s\n' "$*"; }
fail() {
    printf 'FAIL  %s\n' "$*"
    failures=$((failures + 1))
}
# run DESCRIPTION CMD...: runs CMD quietly, prints its output only when it fails.
run() {
    local what="$1" out
    shift
    if out="$("$@" 2>&1)"; then
        ok "$what"
    else
        fail "$what"
        printf '%s\n' "$out" | sed 's/^/      /'
    fi
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# --- tools ------------------------------------------------------------------------------------
missing=()
command -v promtool >/dev/null 2>&1 || missing+=("promtool (apt-get install -y prometheus)")
command -v docker-compose >/dev/null 2>&1 || missing+=("docker-compose (apt-get install -y docker-compose)")
command -v python3 >/dev/null 2>&1 || missing+=("python3")
python3 -c 'import yaml' >/dev/null 2>&1 || missing+=("python3-yaml (apt-get install -y python3-yaml)")
if ((${#missing[@]})); then
    for m in "${missing[@]}"; do fail "tool missing: $m"; done
    echo "check-deploy: $failures check(s) failed"
    exit 1
fi
ok "tools: $(promtool --version 2>&1 | head -n1); $(docker-compose version --short 2>/dev/null || docker-compose --version)"

# --- Prometheus -------------------------------------------------------------------------------
run "promtool check config deploy/prometheus/prometheus.yml (and the rule files it loads)" \
    promtool check config deploy/prometheus/prometheus.yml
run "promtool check rules deploy/prometheus/rules/*.yml" \
    promtool check rules deploy/prometheus/rules/*.yml
run "promtool test rules deploy/prometheus/tests/*.yml" \
    promtool test rules deploy/prometheus/tests/*.yml

# Every alert: severity, annotations, a runbook section, unit tests where it fires and where it
# does not.
run "every alert has severity, summary, description, runbook_url, a runbook section in docs/operations.md and promtool tests (firing and silent)" \
    python3 - <<'EOF'
import glob, re, sys, yaml
errors = []
alerts = []
for f in sorted(glob.glob("deploy/prometheus/rules/*.yml")):
    for g in yaml.safe_load(open(f))["groups"]:
        for r in g["rules"]:
            if "alert" in r:
                alerts.append((f, r))
if not alerts:
    errors.append("no alert rules found")
doc = open("docs/operations.md").read() if glob.glob("docs/operations.md") else ""
headings = set(re.findall(r"^###\s+`?([A-Za-z0-9]+)`?\s*$", doc, re.M))
firing, silent = set(), set()
for f in glob.glob("deploy/prometheus/tests/*.yml"):
    for t in yaml.safe_load(open(f)).get("tests", []):
        for a in t.get("alert_rule_test", []) or []:
            (firing if a.get("exp_alerts") else silent).add(a["alertname"])
names = set()
for f, r in alerts:
    n = r["alert"]
    if n in names:
        errors.append(f"{n}: defined twice")
    names.add(n)
    if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
        errors.append(f"{n}: label severity must be critical, warning or info")
    ann = r.get("annotations", {})
    for k in ("summary", "description", "runbook_url"):
        if not ann.get(k):
            errors.append(f"{n}: annotation {k} missing")
    want = f"docs/operations.md#{n.lower()}"
    if ann.get("runbook_url") != want:
        errors.append(f"{n}: runbook_url must be {want}")
    if n not in headings:
        errors.append(f"{n}: no '### {n}' runbook section in docs/operations.md")
    if n not in firing:
        errors.append(f"{n}: no promtool test where it fires")
    if n not in silent:
        errors.append(f"{n}: no promtool test where it stays silent")
    if "for" not in r:
        errors.append(f"{n}: no for: (tests/tests/system/alerts.rs shortens every for:)")
for n in sorted(firing | silent):
    if n not in names:
        errors.append(f"tests refer to unknown alert {n}")
print("\n".join(errors))
print(f"{len(alerts)} alerts checked")
sys.exit(1 if errors else 0)
EOF

# --- Grafana ----------------------------------------------------------------------------------
mkdir -p "$tmp/dashboards"
if python3 deploy/grafana/generate.py "$tmp/dashboards" >/dev/null 2>"$tmp/generate.err"; then
    if diff -r "$tmp/dashboards" deploy/grafana/dashboards >"$tmp/dashboards.diff"; then
        ok "deploy/grafana/dashboards/*.json are what deploy/grafana/generate.py writes"
    else
        fail "deploy/grafana/dashboards differ from deploy/grafana/generate.py's output: run python3 deploy/grafana/generate.py"
        head -n 20 "$tmp/dashboards.diff" | sed 's/^/      /'
    fi
else
    fail "deploy/grafana/generate.py failed"
    sed 's/^/      /' "$tmp/generate.err"
fi

run "dashboards: valid JSON, unique uids and panel ids, panels inside the 24-column grid, the provisioned datasource" \
    python3 - <<'EOF'
import glob, json, sys, yaml
errors = []
ds = yaml.safe_load(open("deploy/grafana/provisioning/datasources/prometheus.yml"))["datasources"]
ds_uids = {d["uid"] for d in ds}
providers = yaml.safe_load(open("deploy/grafana/provisioning/dashboards/outbox.yml"))["providers"]
if not providers:
    errors.append("no dashboard provider")
uids = {}
files = sorted(glob.glob("deploy/grafana/dashboards/*.json"))
if len(files) < 5:
    errors.append(f"expected 5 dashboards, found {len(files)}")
for f in files:
    try:
        d = json.load(open(f))
    except ValueError as e:
        errors.append(f"{f}: {e}")
        continue
    if d.get("uid") in uids:
        errors.append(f"{f}: uid {d.get('uid')} also in {uids[d['uid']]}")
    uids[d.get("uid")] = f
    ids = [p["id"] for p in d["panels"]]
    if len(ids) != len(set(ids)):
        errors.append(f"{f}: duplicate panel ids")
    for p in d["panels"]:
        g = p["gridPos"]
        if g["x"] < 0 or g["w"] <= 0 or g["x"] + g["w"] > 24:
            errors.append(f"{f}: panel {p['title']!r} outside the grid")
        if p["type"] == "row":
            continue
        if not p.get("description"):
            errors.append(f"{f}: panel {p['title']!r} has no description")
        for t in p.get("targets", []):
            uid = t.get("datasource", {}).get("uid")
            if uid not in ds_uids:
                errors.append(f"{f}: panel {p['title']!r} uses datasource {uid}, provisioned: {sorted(ds_uids)}")
print("\n".join(errors))
print(f"{len(files)} dashboards checked")
sys.exit(1 if errors else 0)
EOF

# Every panel query, with Grafana's variables substituted, must parse as PromQL: promtool checks
# them as recording rules.
python3 - "$tmp/dashboard-queries.yml" <<'EOF'
import glob, json, sys, yaml
subs = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
rules = []
for f in sorted(glob.glob("deploy/grafana/dashboards/*.json")):
    d = json.load(open(f))
    names = [v["name"] for v in d.get("templating", {}).get("list", [])]
    for p in d["panels"]:
        for t in p.get("targets", []):
            e = t["expr"]
            for k, v in subs.items():
                e = e.replace(k, v)
            for n in names:
                e = e.replace("$" + n, ".*")
            rules.append({"record": f"dashboard:query:{len(rules)}", "expr": e})
yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}, open(sys.argv[1], "w"))
EOF
run "every dashboard query parses as PromQL (promtool check rules on $(grep -c 'record:' "$tmp/dashboard-queries.yml") queries)" \
    promtool check rules "$tmp/dashboard-queries.yml"

# Metric names in rules and dashboards must exist in the services' code (renames break panels
# silently otherwise); RabbitMQ names must be among those checked against rabbitmq_prometheus.
run "every outbox_/relay_/consumer_/api_/process_/processes_/provider_ metric in rules and dashboards is emitted by the code; rabbitmq_ metrics are known" \
    python3 - <<'EOF'
import glob, json, re, sys, yaml
sources = "".join(open(f).read() for f in glob.glob("**/src/**/*.rs", recursive=True)
                  if not f.startswith("target/"))
rabbitmq_known = {
    "rabbitmq_queue_messages", "rabbitmq_queue_messages_ready", "rabbitmq_queue_messages_unacked",
    "rabbitmq_queue_consumers", "rabbitmq_channel_messages_published_total",
    "rabbitmq_channel_messages_confirmed_total", "rabbitmq_channel_messages_delivered_ack_total",
    "rabbitmq_channel_messages_unroutable_returned_total", "rabbitmq_channel_messages_unroutable_dropped_total",
    "rabbitmq_alarms_memory_used_watermark", "rabbitmq_alarms_free_disk_space_watermark",
    "rabbitmq_alarms_file_descriptor_limit", "rabbitmq_connections", "rabbitmq_channels",
}
exprs = []
for f in glob.glob("deploy/prometheus/rules/*.yml"):
    exprs += [r["expr"] for g in yaml.safe_load(open(f))["groups"] for r in g["rules"]]
for f in glob.glob("deploy/grafana/dashboards/*.json"):
    exprs += [t["expr"] for p in json.load(open(f))["panels"] for t in p.get("targets", [])]
# Metric names only: not label names or values, not recording rules (level:metric:operations).
names = set()
for e in exprs:
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', e)  # drop string literals (label values)
    names |= set(re.findall(r"(?<![:\w])((?:outbox|relay|consumer|api|processes|process|provider|rabbitmq)_[a-z0-9_]+)\b(?!:)", e))
errors = []
for n in sorted(names):
    if n.startswith("rabbitmq_"):
        if n not in rabbitmq_known:
            errors.append(f"{n}: not a known rabbitmq_prometheus metric (check the name, then add it here)")
        continue
    base = re.sub(r"_(bucket|count|sum)$", "", n)
    if f'"{base}"' not in sources and f'"{n}"' not in sources:
        errors.append(f"{n}: no service emits it (no \"{base}\" in */src)")
print("\n".join(errors))
print(f"{len(names)} metric names checked")
sys.exit(1 if errors else 0)
EOF

# --- compose ----------------------------------------------------------------------------------
run "docker-compose config -q (docker-compose.yml is valid)" docker-compose -f docker-compose.yml config -q
# The broker image is an exact version (no floating tag such as 3-management), overridable with
# RABBITMQ_IMAGE, and the operations guide names the same default.
run "rabbitmq image pinned to an exact version, overridable with RABBITMQ_IMAGE, the same in docs/operations.md" \
    python3 - <<'EOF'
import re, sys, yaml
compose = yaml.safe_load(open("docker-compose.yml"))
image = compose["services"]["rabbitmq"]["image"]
m = re.fullmatch(r"\$\{RABBITMQ_IMAGE:-(rabbitmq:\d+\.\d+\.\d+-management)\}", image)
if not m:
    sys.exit(f"rabbitmq image {image!r}: want ${{RABBITMQ_IMAGE:-rabbitmq:X.Y.Z-management}}")
doc = open("docs/operations.md").read()
if f"`{m.group(1)}`" not in doc:
    sys.exit(f"docs/operations.md does not name the default image `{m.group(1)}`")
EOF

bins=(relay consumer producer payment-provider console)
need_build=()
for b in "${bins[@]}"; do [[ -x "target/debug/$b" ]] || need_build+=(--bin "$b"); done
if ((${#need_build[@]})); then
    echo "      building ${need_build[*]} (target/debug binaries missing)"
    run "cargo build ${need_build[*]}" cargo build "${need_build[@]}"
fi
for b in "${bins[@]}"; do
    if "target/debug/$b" --help >"$tmp/$b.help" 2>&1; then
        ok "target/debug/$b --help ($(grep -o '\[env: [A-Z0-9_]*=' "$tmp/$b.help" | wc -l) env vars)"
    else
        fail "target/debug/$b --help"
    fi
done

docker-compose -f docker-compose.yml config >"$tmp/compose.yml" 2>/dev/null
run "compose services built from ./Dockerfile: commands exist, every env var is accepted by the binary (or read by the script it runs), ports match the scrape targets and health checks" \
    python3 - "$tmp" <<'EOF'
import os, re, sys, yaml
tmp = sys.argv[1]
compose = yaml.safe_load(open(f"{tmp}/compose.yml"))
prom = yaml.safe_load(open("deploy/prometheus/prometheus.yml"))
bins = ("relay", "consumer", "producer", "payment-provider", "console")
accepted = {b: set(re.findall(r"\[env: ([A-Z0-9_]+)[=\]]", open(f"{tmp}/{b}.help").read())) for b in bins}
# Read by shared::telemetry (logging), not clap flags.
everywhere = {"RUST_LOG", "LOG_FORMAT"}
errors, checked = [], 0
ours = {n: s for n, s in compose["services"].items() if "build" in s}
if not ours:
    errors.append("no service is built from ./Dockerfile")
listen = {}
for name, svc in ours.items():
    cmd = svc.get("command")
    if isinstance(cmd, str):
        cmd = cmd.split()
    if not cmd:
        errors.append(f"{name}: no command (the image runs `relay run` by default: say which binary)")
        continue
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    if cmd[0] in bins:
        binary = cmd[0]
        allowed, source = accepted[binary] | everywhere, f"`{binary} --help`"
        if len(cmd) > 1 and not cmd[1].startswith("-"):
            sub_help = os.popen(f"target/debug/{binary} {cmd[1]} --help 2>/dev/null").read()
            if not sub_help:
                errors.append(f"{name}: `{binary} {cmd[1]}` is not a subcommand of {binary}")
            # A subcommand takes its own flags besides the binary's (`producer ledger`).
            allowed |= set(re.findall(r"\[env: ([A-Z0-9_]+)[=\]]", sub_help))
            source = f"`{binary} --help` or `{binary} {cmd[1]} --help`"
        for var in ("METRICS_ADDR", "LISTEN_ADDR", "PROVIDER_ADDR"):
            if var in env and var in accepted[binary]:
                listen[name] = env[var]
    elif cmd[0] in ("bash", "sh") and len(cmd) > 1:
        script = None
        for v in svc.get("volumes", []):
            src, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
            if target == cmd[1]:
                script = src
        if not script or not os.path.isfile(script):
            errors.append(f"{name}: runs {cmd[1]}, which is not mounted from a file of the repository")
            continue
        text = open(script).read()
        allowed = {v for v in env if re.search(r"\$\{?" + v + r"\b", text)} | everywhere
        source = os.path.relpath(script)
    else:
        errors.append(f"{name}: command {cmd[0]!r} is neither one of {bins} nor a bash script")
        continue
    for var in env:
        checked += 1
        if var not in allowed:
            errors.append(f"{name}: env var {var} is not accepted by {source}")
    hc = " ".join(svc.get("healthcheck", {}).get("test", []))
    if name in listen:
        port = listen[name].rsplit(":", 1)[1]
        if not listen[name].startswith("0.0.0.0:"):
            errors.append(f"{name}: {listen[name]} is not reachable from other containers (bind 0.0.0.0)")
        if hc and f":{port}/" not in hc:
            errors.append(f"{name}: health check {hc!r} does not use port {port}")
# Prometheus targets: every compose service it scrapes listens where it is scraped.
for job in prom["scrape_configs"]:
    for sc in job.get("static_configs", []):
        for target in sc["targets"]:
            host, port = target.rsplit(":", 1)
            if host == "localhost":
                continue
            if host not in compose["services"]:
                errors.append(f"prometheus job {job['job_name']}: target {target} is not a compose service")
            elif host in listen and listen[host].rsplit(":", 1)[1] != port:
                errors.append(f"prometheus job {job['job_name']}: {target}, but {host} listens on {listen[host]}")
    if job["job_name"] in ("relay", "consumer", "producer"):
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host = target.rsplit(":", 1)[0]
                cmd = compose["services"].get(host, {}).get("command") or [""]
                # The example consumers are `producer ledger` and `producer notifier` (the demo's
                # binary runs them).
                consumers = (["producer", "ledger"], ["producer", "notifier"])
                runs = "consumer" if cmd[:2] in consumers else cmd[0]
                if runs != job["job_name"]:
                    errors.append(f"prometheus job {job['job_name']} scrapes {host}, which runs {cmd[0]!r}")
print("\n".join(errors))
print(f"{len(ours)} services, {checked} env vars checked")
sys.exit(1 if errors else 0)
EOF

run "compose start order: every depends_on waits for service_healthy (or completion), and every waited-on service has a health check" \
    python3 - "$tmp" <<'EOF'
import sys, yaml
compose = yaml.safe_load(open(f"{sys.argv[1]}/compose.yml"))
errors = []
for name, svc in compose["services"].items():
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        errors.append(f"{name}: depends_on without conditions")
        continue
    for dep, cond in deps.items():
        c = cond.get("condition")
        if c not in ("service_healthy", "service_completed_successfully"):
            errors.append(f"{name}: depends on {dep} with condition {c}")
        if c == "service_healthy" and "healthcheck" not in compose["services"][dep]:
            errors.append(f"{name}: waits for {dep} to be healthy, but {dep} has no health check")
print("\n".join(errors))
sys.exit(1 if errors else 0)
EOF

# --- Dockerfile, scripts ----------------------------------------------------------------------
run "Dockerfile: multi-stage, cargo build --release --locked --bins, debian:bookworm-slim runtime with ca-certificates and curl, non-root, copies relay, consumer, producer, payment-provider, console" \
    python3 - <<'EOF'
import re, sys
d = open("Dockerfile").read()
errors = []
if len(re.findall(r"^FROM\s", d, re.M)) < 2:
    errors.append("not multi-stage")
if "cargo build --release --locked --bins" not in d:
    errors.append("no `cargo build --release --locked --bins`")
if not re.search(r"^FROM debian:\$\{DEBIAN_RELEASE\}-slim|^FROM debian:bookworm-slim", d, re.M):
    errors.append("runtime stage is not debian:bookworm-slim")
for pkg in ("ca-certificates", "curl"):
    if pkg not in d:
        errors.append(f"runtime lacks {pkg}")
users = re.findall(r"^USER\s+(\S+)", d, re.M)
if not users or users[-1].split(":")[0] in ("root", "0"):
    errors.append("the image does not end with a non-root USER")
for b in ("relay", "consumer", "producer", "payment-provider", "console"):
    if f"target/release/{b}" not in d:
        errors.append(f"binary {b} not copied")
ignored = [l.strip().rstrip("/") for l in open(".dockerignore") if l.strip() and not l.startswith("#")]
for needed in ("Cargo.toml", "Cargo.lock", "migrations", "shared", "relay", "consumer", "producer", "console", "bench", "tests"):
    if needed in ignored:
        errors.append(f".dockerignore excludes {needed}, which the build needs")
print("\n".join(errors))
sys.exit(1 if errors else 0)
EOF
for s in deploy/*.sh scripts/check-deploy.sh; do
    run "bash -n $s" bash -n "$s"
done
if command -v shellcheck >/dev/null 2>&1; then
    run "shellcheck deploy/*.sh scripts/check-deploy.sh" shellcheck deploy/*.sh scripts/check-deploy.sh
fi

echo
if ((failures)); then
    echo "check-deploy: $failures check(s) failed"
    exit 1
fi
echo "check-deploy: all checks passed"
