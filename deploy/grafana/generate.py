#!/usr/bin/env python3
"""Writes the Grafana dashboards of the outbox system into deploy/grafana/dashboards/.

The JSON files are generated, not edited by hand: change this file and run

    python3 deploy/grafana/generate.py

scripts/check-deploy.sh fails when the committed JSON differs from what this script writes, and
checks every query of every panel with promtool. Grafana provisions the files at start
(deploy/grafana/provisioning/dashboards/outbox.yml); docs/operations.md explains each panel.

Conventions of the queries:
- Relays all report the same global outbox gauges (pending, oldest age, dead, unrouted):
  aggregated with max(), never sum().
- Histogram bucket labels: le as exposed by the services ("5" in Prometheus 2, "5.0" in 3); the
  quantile queries do not depend on it.
- RabbitMQ series come from its rabbitmq_prometheus plugin, scraped per object (job rabbitmq).
- Process workers (processes crate) all report the same global gauges (processes_active,
  process_manual_review_*): max() over the workers as well; their counters are summed.
"""

import json
import pathlib
import sys

DS = {"type": "prometheus", "uid": "prometheus"}
OUT = pathlib.Path(__file__).resolve().parent / "dashboards"
RI = "$__rate_interval"

# Queues that are not a consumer's main queue (PromQL regex inside a string literal).
AUX_QUEUES = r".*\\.(dlq|unrouted)|.*\\.retry\\..*"
DLQ = r".+\\.dlq"


# ------------------------------------------------------------------------------------------------
# Panel builders


class Ids:
    def __init__(self):
        self.n = 0

    def next(self):
        self.n += 1
        return self.n


def target(expr, legend="", ref="A", fmt=None, instant=False):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": not instant}
    if instant:
        t["instant"] = True
    if fmt:
        t["format"] = fmt
    return t


def targets(*pairs):
    """(expr, legend) pairs -> targets A, B, C..."""
    return [target(e, l, chr(ord("A") + i)) for i, (e, l) in enumerate(pairs)]


def thresholds(*steps):
    """steps: (value or None, color)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def timeseries(title, description, tgts, unit="short", stack=False, min0=True,
               threshold_steps=None, overrides=None, legend_calcs=("lastNotNull", "max"),
               draw="line", log_scale=False):
    custom = {
        "drawStyle": draw,
        "lineWidth": 1,
        "fillOpacity": 25 if stack else 10,
        "gradientMode": "none",
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "axisPlacement": "auto",
        "thresholdsStyle": {"mode": "line+area" if threshold_steps else "off"},
    }
    if log_scale:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    defaults = {
        "unit": unit,
        "custom": custom,
        "color": {"mode": "palette-classic"},
        "thresholds": thresholds(*(threshold_steps or [(None, "green")])),
    }
    if min0 and not log_scale:
        defaults["min"] = 0
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": list(legend_calcs)},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title, description, expr, unit="short", steps=None, decimals=None, legend=""):
    defaults = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": thresholds(*(steps or [(None, "green")])),
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, legend)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        },
    }


def heatmap(title, description, bucket_selector, unit="s"):
    """A heatmap of a Prometheus histogram: increase of each bucket per interval."""
    expr = f"sum by (le) (increase({bucket_selector}[{RI}]))"
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, "{{le}}", fmt="heatmap")],
        "fieldConfig": {"defaults": {"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False}}},
                        "overrides": []},
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5,
                      "steps": 64, "reverse": False, "fill": "dark-orange"},
            "filterValues": {"le": 1e-9},
            "rowsFrame": {"layout": "auto"},
            "yAxis": {"axisPlacement": "left", "unit": unit, "reverse": False},
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
            "legend": {"show": True},
            "showValue": "never",
            "cellValues": {"unit": "short"},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
        },
    }


def quantiles(metric, by="", selector="", qs=(0.5, 0.9, 0.99)):
    """histogram_quantile targets for `metric` (without _bucket), optionally split by labels."""
    by_clause = f"{by}, le" if by else "le"
    prefix = "{{" + by.replace(", ", "}} {{") + "}} " if by else ""
    return targets(*[
        (f"histogram_quantile({q}, sum by ({by_clause}) (rate({metric}_bucket{selector}[{RI}])))",
         f"{prefix}p{int(q * 100) if q * 100 == int(q * 100) else q * 100}")
        for q in qs
    ])


def row(title):
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(rows):
    """rows: list of (height, [panel or (panel, width)]) or a row panel. Widths default to equal."""
    panels, y, ids = [], 0, Ids()
    for item in rows:
        if isinstance(item, dict):  # a row header
            item = dict(item, id=ids.next(), gridPos={"h": 1, "w": 24, "x": 0, "y": y})
            panels.append(item)
            y += 1
            continue
        h, items = item
        items = [i if isinstance(i, tuple) else (i, None) for i in items]
        free = [i for i in items if i[1] is None]
        fixed = sum(w for _, w in items if w is not None)
        default_w = (24 - fixed) // len(free) if free else 0
        x = 0
        for p, w in items:
            w = w or default_w
            panels.append(dict(p, id=ids.next(), gridPos={"h": h, "w": w, "x": x, "y": y}))
            x += w
        y += h
    return panels


def variable(name, label, query, multi=True):
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "definition": query,
        "refresh": 2,
        "includeAll": multi,
        "multi": multi,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {},
        "sort": 1,
        "hide": 0,
        "options": [],
        "regex": "",
        "skipUrlSync": False,
    }


def dashboard(uid, title, description, panels, variables=()):
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["outbox"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
            "type": "dashboard"}]},
        "links": [{"title": "Outbox dashboards", "type": "dashboards", "tags": ["outbox"],
                   "asDropdown": True, "includeVars": False, "keepTime": True, "icon": "external link",
                   "targetBlank": False, "tooltip": "", "url": ""}],
        "templating": {"list": list(variables)},
        "panels": panels,
    }


# ------------------------------------------------------------------------------------------------
# Shared queries

PENDING = "max(outbox_pending_messages)"
OLDEST = "max(outbox_oldest_pending_age_seconds)"
DEAD_ROWS = "max(outbox_dead_messages)"
UNROUTED = "max(relay_unrouted_messages)"
PUBLISHED = f"sum(rate(relay_published_total[{RI}]))"
API_WRITES = f'sum(rate(api_idempotency_outcomes_total{{outcome=~"new|expired|taken_over"}}[{RI}]))'
CONSUMED = f'sum(rate(consumer_messages_total{{outcome!="retried"}}[{RI}]))'
RMQ_CONFIRMED = f"sum(rate(rabbitmq_channel_messages_confirmed_total[{RI}]))"
RMQ_DELIVERED = f"sum(rate(rabbitmq_channel_messages_delivered_ack_total[{RI}]))"
QUEUED_READY = f'sum(rabbitmq_queue_messages_ready{{queue!~"{AUX_QUEUES}"}})'
QUEUED_UNACKED = f'sum(rabbitmq_queue_messages_unacked{{queue!~"{AUX_QUEUES}"}})'
DLQ_DEPTH = f'sum(rabbitmq_queue_messages{{queue=~"{DLQ}"}})'

AGE_STEPS = [(None, "green"), (60, "orange"), (600, "red")]


# ------------------------------------------------------------------------------------------------
# Overview


def overview():
    p = [
        row("Now"),
        (4, [
            stat("Outbox backlog", "Rows waiting in the outbox to be published (max over the relays, which all "
                 "report the same global count).", PENDING, steps=[(None, "green"), (1000, "orange"), (10000, "red")]),
            stat("Oldest pending age", "Age of the oldest row not yet published. Alerts: "
                 "OutboxOldestPendingAgeHigh (> 60 s), OutboxOldestPendingAgeCritical (> 10 min).",
                 OLDEST, unit="s", steps=AGE_STEPS),
            stat("Dead outbox rows", "Rows that exhausted their publish attempts; `relay dead list` shows them. "
                 "Alert: OutboxDeadMessages.", DEAD_ROWS, steps=[(None, "green"), (1, "red")]),
            stat("Dead-letter queues", "Messages waiting in the consumers' dead-letter queues (RabbitMQ, all "
                 "*.dlq queues); `consumer dlq list` shows them.", f"{DLQ_DEPTH} or vector(0)",
                 steps=[(None, "green"), (1, "orange")]),
            stat("Relays ready", "Relays connected to PostgreSQL and RabbitMQ (relay_ready), over relays "
                 "scraped.", 'sum(relay_ready) or vector(0)', steps=[(None, "red"), (1, "orange"), (2, "green")]),
            stat("Firing alerts", "Alerts firing in Prometheus now (http://localhost:9090/alerts).",
                 'count(ALERTS{alertstate="firing"}) or vector(0)', steps=[(None, "green"), (1, "red")]),
        ]),
        row("Flow: produce, publish, consume"),
        (9, [
            timeseries(
                "Events per second along the flow",
                "API writes: POST requests that ran their effect (idempotency outcomes new, expired, "
                "taken_over), each writing one outbox event. Published: rows the relays got confirmed by "
                "RabbitMQ. RabbitMQ confirmed: confirms RabbitMQ sent to all publishers (relays; consumer "
                "retry and dead-letter copies). Consumed: deliveries the consumers settled (processed, "
                "duplicate, ignored, dead-lettered; retries excluded). RabbitMQ delivered: deliveries to "
                "consumers. In steady state all lines meet; a gap tells where the flow is held back. The "
                "demo's payment.captured events are written by the payment process worker, not the API, so "
                "published > API writes there.",
                targets((API_WRITES, "API writes"), (PUBLISHED, "published (relays)"),
                        (RMQ_CONFIRMED, "RabbitMQ confirmed"), (CONSUMED, "consumed (consumers)"),
                        (RMQ_DELIVERED, "RabbitMQ delivered")),
                unit="ops"),
            timeseries(
                "Consumer outcomes",
                "What happened to each delivery, all consumers: processed (effect committed), duplicate "
                "(already processed: skipped), ignored (no handler), retried (transient failure, copy in a "
                "retry queue), dead_lettered.",
                targets((f"sum by (outcome) (rate(consumer_messages_total[{RI}]))", "{{outcome}}")),
                unit="ops", stack=True),
        ]),
        row("Backlog: where events wait"),
        (8, [
            timeseries(
                "Waiting events",
                "Outbox backlog: rows not yet published (the relays are behind or cut off). Consumer queues: "
                "ready and unacknowledged messages in the consumers' main queues (the consumers are behind). "
                "Unrouted: events no queue was bound for, kept by the alternate exchange.",
                targets((PENDING, "outbox backlog"), (QUEUED_READY, "consumer queues: ready"),
                        (QUEUED_UNACKED, "consumer queues: unacked"), (UNROUTED, "unrouted (alternate exchange)"))),
            timeseries(
                "Oldest pending outbox row",
                "Age of the oldest pending outbox row. Normally well under a second; it grows while the "
                "relays cannot publish, or while a refused row holds back its partition (retry backoff). "
                "Lines: alert thresholds 60 s and 10 min.",
                targets((OLDEST, "oldest pending age")), unit="s", threshold_steps=AGE_STEPS),
            timeseries(
                "End-to-end latency (outbox insert to consumer commit)",
                "Quantiles over all consumers of consumer_end_to_end_latency_seconds. SLO: 99% within 5 s.",
                quantiles("consumer_end_to_end_latency_seconds", qs=(0.5, 0.99)), unit="s",
                threshold_steps=[(None, "green"), (5, "red")]),
        ]),
        row("Failures"),
        (8, [
            timeseries(
                "Dead outbox rows",
                "Dead rows in the outbox (gauge) and rows becoming dead per second (relay_dead_total). A row "
                "dies after RELAY_MAX_ATTEMPTS nacks or unroutable returns; outages do not count.",
                targets((DEAD_ROWS, "dead rows"), (f"sum(rate(relay_dead_total[{RI}])) or vector(0)", "becoming dead /s"))),
            timeseries(
                "Dead-letter queues",
                "Depth of each consumer's dead-letter queue (RabbitMQ) and dead letters per second by consumer "
                "and reason (consumer_dead_letters_total).",
                targets((f'sum by (queue) (rabbitmq_queue_messages{{queue=~"{DLQ}"}})', "{{queue}} depth"),
                        (f"sum by (consumer, kind) (rate(consumer_dead_letters_total[{RI}]))",
                         "{{consumer}} {{kind}} /s"))),
            timeseries(
                "Duplicates skipped",
                "Deliveries a consumer had already processed, skipped by deduplication: redeliveries after a "
                "relay or consumer crash or a cut link (at-least-once). Relay reconnects explain bursts.",
                targets((f'sum by (consumer) (rate(consumer_messages_total{{outcome="duplicate"}}[{RI}]))',
                         "{{consumer}} duplicates /s"),
                        (f"sum by (target) (increase(relay_reconnects_total[{RI}]))", "relay reconnects to {{target}}")),
                unit="short"),
        ]),
    ]
    return dashboard(
        "outbox-overview", "Outbox: flow overview",
        "The flow API -> outbox -> relays -> RabbitMQ -> consumers at a glance. See docs/operations.md.",
        layout(p))


# ------------------------------------------------------------------------------------------------
# Relay


def relay():
    sel = '{instance=~"$instance"}'
    p = [
        row("Instances"),
        (4, [
            stat("Relays up", "Relay targets Prometheus scrapes successfully.",
                 'count(up{job="relay"} == 1) or vector(0)', steps=[(None, "red"), (1, "orange"), (2, "green")]),
            stat("Relays ready", "Relays connected to PostgreSQL and RabbitMQ.", "sum(relay_ready) or vector(0)",
                 steps=[(None, "red"), (1, "orange"), (2, "green")]),
            stat("Partitions owned", "Outbox partitions held by some relay, out of 64. Below 64 for longer than a "
                 "lease (RELAY_LEASE_MS) means a partition is not published.",
                 "sum(relay_owned_partitions) or vector(0)", steps=[(None, "red"), (64, "green")]),
            stat("Publish p99", "99th percentile of outbox insert to broker confirm, all relays.",
                 f"histogram_quantile(0.99, sum by (le) (rate(relay_publish_latency_seconds_bucket[{RI}])))",
                 unit="s", steps=[(None, "green"), (1, "orange"), (5, "red")]),
            stat("Outbox backlog", "Rows waiting to be published.", PENDING,
                 steps=[(None, "green"), (1000, "orange"), (10000, "red")]),
            stat("Oldest pending age", "Age of the oldest pending row.", OLDEST, unit="s", steps=AGE_STEPS),
        ]),
        (7, [
            timeseries("Ready per instance",
                       "relay_ready: 1 when the relay is connected to PostgreSQL and RabbitMQ. 0 while a link is "
                       "down (the relay retries by itself; /readyz says which link). Alert: RelayNotReady.",
                       targets((f"relay_ready{sel}", "{{instance}}"), (f'up{{job="relay",instance=~"$instance"}}',
                                                                       "{{instance}} scraped (up)")),
                       legend_calcs=("lastNotNull", "min")),
            timeseries("Partitions owned per instance",
                       "relay_owned_partitions, stacked: 64 in total when every partition has an owner. When a "
                       "relay stops, its share moves to the others (at once on SIGTERM, after the lease on "
                       "a crash).",
                       targets((f"relay_owned_partitions{sel}", "{{instance}}")), stack=True),
            timeseries("Reconnects",
                       "Reconnections per interval by relay and dependency (relay_reconnects_total).",
                       targets((f"sum by (instance, target) (increase(relay_reconnects_total{sel}[{RI}]))",
                                "{{instance}} {{target}}")), draw="bars"),
        ]),
        row("Publishing"),
        (8, [
            timeseries("Published per second",
                       "Rows confirmed by the broker and marked, per relay (relay_published_total), and RabbitMQ's "
                       "own count of confirms and publishes it received on all channels.",
                       targets((f"sum by (instance) (rate(relay_published_total{sel}[{RI}]))", "{{instance}}"),
                               (RMQ_CONFIRMED, "RabbitMQ: confirms sent"),
                               (f"sum(rate(rabbitmq_channel_messages_published_total[{RI}]))",
                                "RabbitMQ: messages received")),
                       unit="ops"),
            timeseries("Publish failures by reason",
                       "Publishes that did not count (relay_publish_failures_total): nack, unroutable and broker_refused are "
                       "charged to the row (dead after RELAY_MAX_ATTEMPTS); unpublishable rows go dead at once; "
                       "confirm_timeout and connection are the link's "
                       "and retried without limit. RabbitMQ's unroutable counters explain 'unroutable'.",
                       targets((f"sum by (reason) (rate(relay_publish_failures_total{sel}[{RI}]))", "{{reason}}"),
                               (f"sum(rate(rabbitmq_channel_messages_unroutable_returned_total[{RI}]))",
                                "RabbitMQ: returned unroutable"),
                               (f"sum(rate(rabbitmq_channel_messages_unroutable_dropped_total[{RI}]))",
                                "RabbitMQ: dropped unroutable")),
                       unit="ops"),
            timeseries("Dead and unrouted",
                       "Dead outbox rows (gauge), rows becoming dead per second, and events kept in the "
                       "alternate exchange queue because no queue was bound for their routing key.",
                       targets((DEAD_ROWS, "dead rows"), (f"sum(rate(relay_dead_total{sel}[{RI}])) or vector(0)", "becoming dead /s"),
                               (UNROUTED, "unrouted"))),
        ]),
        row("Latency: outbox insert to broker confirm"),
        (9, [
            heatmap("Publish latency (heatmap)",
                    "Distribution of relay_publish_latency_seconds: from the row's insert (created_at) to the "
                    "broker's confirm. Includes the time a row waited in the outbox.",
                    f"relay_publish_latency_seconds_bucket{sel}"),
            timeseries("Publish latency quantiles",
                       "p50, p90, p99 of relay_publish_latency_seconds over the selected relays, and p99 per relay.",
                       quantiles("relay_publish_latency_seconds", selector=sel)
                       + [target(f"histogram_quantile(0.99, sum by (instance, le) "
                                 f"(rate(relay_publish_latency_seconds_bucket{sel}[{RI}])))",
                                 "{{instance}} p99", "D")],
                       unit="s"),
        ]),
        row("Batches"),
        (8, [
            heatmap("Batch size (heatmap)",
                    "Rows per claimed batch (relay_batch_size). Small batches under load mean the relays keep "
                    "up row by row; batches at RELAY_BATCH_SIZE mean they are catching up.",
                    f"relay_batch_size_bucket{sel}", unit="short"),
            timeseries("Batch size and rate",
                       "Median and p99 rows per batch, mean rows per batch, and batches claimed per second.",
                       quantiles("relay_batch_size", selector=sel, qs=(0.5, 0.99))
                       + [target(f"sum(rate(relay_batch_size_sum{sel}[{RI}])) / sum(rate(relay_batch_size_count{sel}[{RI}]))",
                                 "mean", "C"),
                          target(f"sum(rate(relay_batch_size_count{sel}[{RI}]))", "batches /s", "D")]),
        ]),
        row("RabbitMQ"),
        (7, [
            timeseries("Broker resource alarms",
                       "1 while RabbitMQ's memory or disk alarm is raised: it then blocks publishers, which the "
                       "relays see as confirm timeouts.",
                       targets(("max(rabbitmq_alarms_memory_used_watermark)", "memory alarm"),
                               ("max(rabbitmq_alarms_free_disk_space_watermark)", "disk alarm"),
                               ("max(rabbitmq_alarms_file_descriptor_limit)", "file descriptor alarm")),
                       legend_calcs=("lastNotNull", "max")),
            timeseries("Connections and channels",
                       "Open AMQP connections and channels on the broker (relays, consumers, tools).",
                       targets(("sum(rabbitmq_connections)", "connections"), ("sum(rabbitmq_channels)", "channels"))),
        ]),
    ]
    return dashboard(
        "outbox-relay", "Outbox: relays",
        "Relay instances, publishing, failures, latency and batches. See docs/operations.md.",
        layout(p),
        [variable("instance", "Relay", "label_values(relay_ready, instance)")])


# ------------------------------------------------------------------------------------------------
# Consumer


def consumer():
    sel = '{consumer=~"$consumer"}'
    queues = '{queue=~"($consumer)"}'
    p = [
        row("Now"),
        (4, [
            stat("Consumed per second", "Deliveries settled per second (retries excluded).",
                 f'sum(rate(consumer_messages_total{{consumer=~"$consumer",outcome!="retried"}}[{RI}]))', unit="ops"),
            stat("Processed per second", "Effects committed per second.",
                 f'sum(rate(consumer_messages_total{{consumer=~"$consumer",outcome="processed"}}[{RI}]))', unit="ops"),
            stat("End-to-end p99", "99th percentile of outbox insert to consumer commit. SLO: 99% within 5 s.",
                 f"histogram_quantile(0.99, sum by (le) (rate(consumer_end_to_end_latency_seconds_bucket{sel}[{RI}])))",
                 unit="s", steps=[(None, "green"), (1, "orange"), (5, "red")]),
            stat("Slow events (1 h)", "Share of events slower than 5 s end to end over the last hour (recording "
                 "rule consumer:end_to_end_latency_slow:ratio_rate1h). Error budget: 1%.",
                 f"max(consumer:end_to_end_latency_slow:ratio_rate1h{sel})", unit="percentunit",
                 steps=[(None, "green"), (0.01, "orange"), (0.144, "red")], decimals=2),
            stat("Queue ready", "Messages ready in the selected consumers' main queues.",
                 f"sum(rabbitmq_queue_messages_ready{queues}) or vector(0)",
                 steps=[(None, "green"), (1000, "orange"), (10000, "red")]),
            stat("Dead-letter queue", "Messages in the selected consumers' dead-letter queues.",
                 f'sum(rabbitmq_queue_messages{{queue=~"($consumer)\\\\.dlq"}}) or vector(0)',
                 steps=[(None, "green"), (1, "orange")]),
        ]),
        row("Outcomes"),
        (8, [
            timeseries("Outcomes per second",
                       "consumer_messages_total by outcome: processed (effect committed), duplicate (skipped by "
                       "deduplication), ignored (no handler for the event type, not strict), retried (copy parked "
                       "in a retry queue), dead_lettered (sent to NAME.dlq).",
                       targets((f"sum by (consumer, outcome) (rate(consumer_messages_total{sel}[{RI}]))",
                                "{{consumer}} {{outcome}}")),
                       unit="ops", stack=True),
            timeseries("Dead letters by reason",
                       "consumer_dead_letters_total by kind: permanent (handler said it never works), exhausted "
                       "(transient failures past CONSUMER_MAX_ATTEMPTS), undecodable, unknown_event_type (strict).",
                       targets((f"sum by (consumer, kind) (rate(consumer_dead_letters_total{sel}[{RI}]))",
                                "{{consumer}} {{kind}}")),
                       unit="ops"),
            timeseries("Duplicate and dead-letter ratio",
                       "Share of settled deliveries that were duplicates, and that were dead-lettered (alert "
                       "ConsumerDeadLetterRateHigh above 1%).",
                       targets((f'sum by (consumer) (rate(consumer_messages_total{{consumer=~"$consumer",outcome="duplicate"}}[{RI}]))'
                                f' / sum by (consumer) (rate(consumer_messages_total{{consumer=~"$consumer",outcome!="retried"}}[{RI}]))',
                                "{{consumer}} duplicates"),
                               (f'sum by (consumer) (rate(consumer_messages_total{{consumer=~"$consumer",outcome="dead_lettered"}}[{RI}]))'
                                f' / sum by (consumer) (rate(consumer_messages_total{{consumer=~"$consumer",outcome!="retried"}}[{RI}]))',
                                "{{consumer}} dead-lettered")),
                       unit="percentunit"),
        ]),
        row("End-to-end latency: outbox insert to consumer commit"),
        (9, [
            heatmap("End-to-end latency (heatmap)",
                    "consumer_end_to_end_latency_seconds: outbox created_at to the commit of the effect, for "
                    "processed messages. Includes the outbox wait, publishing, queueing and the handler.",
                    f"consumer_end_to_end_latency_seconds_bucket{sel}"),
            timeseries("End-to-end latency quantiles",
                       "p50, p90, p99 per consumer. The SLO line is 5 s.",
                       quantiles("consumer_end_to_end_latency_seconds", by="consumer", selector=sel),
                       unit="s", threshold_steps=[(None, "green"), (5, "red")]),
            timeseries("SLO: error budget burn rate",
                       "Share of events slower than 5 s divided by the budget (1%), over 5 m, 30 m, 1 h and 6 h "
                       "(recording rules). 1 = exactly on budget. Alerts: EndToEndLatencySLOBurnFast (1 h and 5 m "
                       "above 14.4), EndToEndLatencySLOBurnSlow (6 h and 30 m above 6).",
                       targets(*[(f"consumer:end_to_end_latency_slow:ratio_rate{w}{sel} / 0.01", f"{{{{consumer}}}} {w}")
                                 for w in ("5m", "30m", "1h", "6h")]),
                       threshold_steps=[(None, "green"), (6, "orange"), (14.4, "red")]),
        ]),
        row("Handler and batches"),
        (8, [
            heatmap("Handler duration (heatmap)", "consumer_handler_duration_seconds: one handler call.",
                    f"consumer_handler_duration_seconds_bucket{sel}"),
            timeseries("Handler duration quantiles", "p50, p90, p99 of one handler call, per consumer.",
                       quantiles("consumer_handler_duration_seconds", by="consumer", selector=sel), unit="s"),
            timeseries("Batches",
                       "Deliveries per batch transaction (p50, p99) and the p99 time from a batch's first delivery "
                       "to its acknowledgement.",
                       quantiles("consumer_batch_size", by="consumer", selector=sel, qs=(0.5, 0.99))
                       + [target(f"histogram_quantile(0.99, sum by (consumer, le) "
                                 f"(rate(consumer_batch_duration_seconds_bucket{sel}[{RI}])))",
                                 "{{consumer}} batch duration p99 (s)", "C")]),
        ]),
        row("Health"),
        (7, [
            timeseries("Instances",
                       "Consumer targets scraped (up) and RabbitMQ consumers attached to each main queue. A queue "
                       "with messages and no consumer fires ConsumerQueueUnconsumed.",
                       targets(('up{job="consumer"}', "{{instance}} up"),
                               (f"sum by (queue) (rabbitmq_queue_consumers{queues})", "{{queue}} consumers"))),
            timeseries("Database failures and reconnects",
                       "Batches rolled back by a database infrastructure error (retried, not dead-lettered) and "
                       "RabbitMQ sessions re-established, per interval.",
                       targets((f"sum by (consumer) (increase(consumer_database_failures_total{sel}[{RI}]))",
                                "{{consumer}} database failures"),
                               (f"sum by (consumer) (increase(consumer_reconnects_total{sel}[{RI}]))",
                                "{{consumer}} reconnects")),
                       draw="bars"),
            timeseries("Deduplication rows deleted",
                       "processed_messages rows removed by the retention sweep (CONSUMER_RETENTION).",
                       targets((f"sum by (consumer) (increase(consumer_dedup_rows_deleted_total{sel}[{RI}]))",
                                "{{consumer}}")),
                       draw="bars"),
        ]),
        row("RabbitMQ queues"),
        (8, [
            timeseries("Main queue depth",
                       "Ready (waiting for a consumer) and unacknowledged (delivered, batch not committed yet) "
                       "messages in the selected consumers' main queues.",
                       targets((f"sum by (queue) (rabbitmq_queue_messages_ready{queues})", "{{queue}} ready"),
                               (f"sum by (queue) (rabbitmq_queue_messages_unacked{queues})", "{{queue}} unacked"))),
            timeseries("Retry and dead-letter queues",
                       "Messages parked in the retry queues (NAME.retry.DELAY, back in the main queue after the "
                       "delay) and in the dead-letter queue (NAME.dlq, until replayed).",
                       targets((f'sum by (queue) (rabbitmq_queue_messages{{queue=~"($consumer)\\\\.retry\\\\..+"}})',
                                "{{queue}}"),
                               (f'sum by (queue) (rabbitmq_queue_messages{{queue=~"($consumer)\\\\.dlq"}})',
                                "{{queue}}"))),
        ]),
    ]
    return dashboard(
        "outbox-consumer", "Outbox: consumers",
        "Consumer outcomes, latency, handler, batches and queues. See docs/operations.md.",
        layout(p),
        [variable("consumer", "Consumer", "label_values(consumer_messages_total, consumer)")])


# ------------------------------------------------------------------------------------------------
# API


def error_ratio_by_route(status):
    """Share of responses with `status` (regex) per route; 0, not missing, when there are none."""
    total = f'sum by (method, route) (rate(api_request_duration_seconds_count{{route=~"$route"}}[{RI}]))'
    errors = (f'sum by (method, route) (rate(api_request_duration_seconds_count'
              f'{{route=~"$route",status=~"{status}"}}[{RI}]))')
    return f"({errors} or 0 * {total}) / {total}"


def api():
    sel = '{route=~"$route"}'
    ops = "api_idempotency_outcomes_total"
    p = [
        row("Now"),
        (4, [
            stat("Requests per second", "All API requests.",
                 f"sum(rate(api_request_duration_seconds_count{sel}[{RI}]))", unit="reqps"),
            stat("5xx ratio", "Share of requests answered with a server error.",
                 f'(sum(rate(api_request_duration_seconds_count{{route=~"$route",status=~"5.."}}[{RI}])) or vector(0))'
                 f" / sum(rate(api_request_duration_seconds_count{sel}[{RI}]))",
                 unit="percentunit", steps=[(None, "green"), (0.001, "orange"), (0.01, "red")], decimals=2),
            stat("p99 latency", "99th percentile of all requests.",
                 f"histogram_quantile(0.99, sum by (le) (rate(api_request_duration_seconds_bucket{sel}[{RI}])))",
                 unit="s", steps=[(None, "green"), (0.25, "orange"), (1, "red")]),
            stat("Replayed", "Share of POST requests answered from a stored response (retries with the same key).",
                 f'sum(rate({ops}{{outcome="replayed"}}[{RI}])) / sum(rate({ops}[{RI}]))',
                 unit="percentunit", decimals=1),
            stat("Conflicts", "Share of POST requests rejected with 409 because their key was still processing. "
                 "Alert IdempotencyConflictsSpiking above 5%.",
                 f'sum(rate({ops}{{outcome="conflict"}}[{RI}])) / sum(rate({ops}[{RI}]))',
                 unit="percentunit", steps=[(None, "green"), (0.01, "orange"), (0.05, "red")], decimals=2),
            stat("Key mismatches", "Share of POST requests rejected with 422 because their key was used with "
                 "another body.",
                 f'sum(rate({ops}{{outcome="mismatch"}}[{RI}])) / sum(rate({ops}[{RI}]))',
                 unit="percentunit", steps=[(None, "green"), (0.01, "orange")], decimals=2),
        ]),
        row("Traffic"),
        (8, [
            timeseries("Requests per second by route and status",
                       "api_request_duration_seconds_count by route template, method and status (route "
                       "`unmatched` for 404s on unknown paths).",
                       targets((f"sum by (method, route, status) (rate(api_request_duration_seconds_count{sel}[{RI}]))",
                                "{{method}} {{route}} {{status}}")),
                       unit="reqps", stack=True),
            timeseries("Error ratio by route",
                       "Share of 4xx and 5xx responses per route. 4xx include expected client errors (validation, "
                       "conflicts, mismatches, unknown ids).",
                       targets((error_ratio_by_route("5.."), "{{method}} {{route}} 5xx"),
                               (error_ratio_by_route("4.."), "{{method}} {{route}} 4xx")),
                       unit="percentunit"),
        ]),
        row("Latency"),
        (9, [
            timeseries("Latency per route (p50, p99)",
                       "Quantiles of api_request_duration_seconds per route and method, all statuses.",
                       targets((f"histogram_quantile(0.5, sum by (method, route, le) "
                                f"(rate(api_request_duration_seconds_bucket{sel}[{RI}])))", "{{method}} {{route}} p50"),
                               (f"histogram_quantile(0.99, sum by (method, route, le) "
                                f"(rate(api_request_duration_seconds_bucket{sel}[{RI}])))", "{{method}} {{route}} p99")),
                       unit="s"),
            heatmap("Latency (heatmap)", "api_request_duration_seconds of the selected routes.",
                    f"api_request_duration_seconds_bucket{sel}"),
        ]),
        row("Idempotency-Key"),
        (8, [
            timeseries("Idempotency outcomes",
                       "api_idempotency_outcomes_total by outcome: new (first use, effect runs), replayed (stored "
                       "response returned, no new effect), conflict (409: same key still processing), mismatch "
                       "(422: same key, other body), expired (old record, counts as new), taken_over (holder's "
                       "lease expired, effect runs).",
                       targets((f"sum by (outcome) (rate({ops}[{RI}]))", "{{outcome}}")),
                       unit="ops", stack=True),
            timeseries("Outcomes by operation",
                       "The same per operation (create_order, create_payment).",
                       targets((f"sum by (operation, outcome) (rate({ops}[{RI}]))", "{{operation}} {{outcome}}")),
                       unit="ops"),
            timeseries("Conflict ratio",
                       "Share of requests per operation that got 409 conflict; the line is the 5% alert threshold "
                       "(IdempotencyConflictsSpiking, also needs more than 0.1/s).",
                       targets((f'sum by (operation) (rate({ops}{{outcome="conflict"}}[{RI}])) / '
                                f"sum by (operation) (rate({ops}[{RI}]))", "{{operation}}")),
                       unit="percentunit", threshold_steps=[(None, "green"), (0.05, "red")]),
        ]),
        (7, [
            timeseries("Reservations released",
                       "Keys released without effect so a retry can run (api_idempotency_released_total): the "
                       "effect failed (error), panicked, or the client went away (cancelled).",
                       targets((f"sum by (operation, reason) (increase(api_idempotency_released_total[{RI}]))",
                                "{{operation}} {{reason}}")),
                       draw="bars"),
            timeseries("Expired records purged",
                       "Idempotency records deleted by the purge after IDEMPOTENCY_TTL_SECS.",
                       targets((f"sum(increase(api_idempotency_purged_total[{RI}])) or vector(0)", "purged")), draw="bars"),
        ]),
    ]
    return dashboard(
        "outbox-api", "Outbox: producer API",
        "Request rates, latency per route and Idempotency-Key outcomes. See docs/operations.md.",
        layout(p),
        [variable("route", "Route", "label_values(api_request_duration_seconds_count, route)")])

# ------------------------------------------------------------------------------------------------
# Processes


def processes():
    k = 'kind=~"$kind"'
    unfinished = 'status=~"pending|running|waiting|compensating"'
    # Every worker reports the same global status gauges: max over the workers, never the sum.
    active = f"max by (kind, status) (processes_active{{{k}}})"
    p = [
        row("Now"),
        (4, [
            stat("Unfinished processes", "Processes pending, running, waiting (backoff) or compensating, all "
                 "selected kinds (processes_active; max over the workers, which all report the same global "
                 "counts). Alerts: ProcessesStuck, ProcessWorkersGone.",
                 f"sum(max by (kind, status) (processes_active{{{k},{unfinished}}})) or vector(0)"),
            stat("Manual review backlog", "Processes waiting in manual_review for a person (all kinds): the console's "
                 "process list with status manual_review shows them.",
                 "max(process_manual_review_backlog) or vector(0)", steps=[(None, "green"), (1, "orange")]),
            stat("Oldest in manual review", "How long the oldest process in manual_review has waited (all kinds). "
                 "Alert: ProcessManualReviewAgeHigh (> 1 h).",
                 "max(process_manual_review_oldest_age_seconds) or vector(0)", unit="s",
                 steps=[(None, "green"), (600, "orange"), (3600, "red")]),
            stat("Unknown outcomes (1 h)", "Attempts whose outcome was unknown (timeout after the remote may have "
                 "acted, a lost worker) in the last hour, however they are being resolved.",
                 f"sum(increase(process_unknown_outcomes_total{{{k}}}[1h])) or vector(0)",
                 steps=[(None, "green"), (1, "orange")], decimals=0),
            stat("Fenced writes (1 h)", "Writes refused in the last hour because the worker's lease had been taken "
                 "over (its work is discarded and redone). Alert: ProcessFencedWrites.",
                 f"sum(increase(process_fenced_writes_total{{{k}}}[1h])) or vector(0)",
                 steps=[(None, "green"), (1, "orange")], decimals=0),
            stat("Start to succeeded p99", "99th percentile from start to succeeded, selected kinds. The histogram "
                 "buckets end at 60 s: longer processes show as 60 s.",
                 f'histogram_quantile(0.99, sum by (le) (rate(process_latency_seconds_bucket{{{k},status="succeeded"}}[{RI}])))',
                 unit="s", steps=[(None, "green"), (1, "orange"), (30, "red")]),
        ]),
        row("Processes"),
        (8, [
            timeseries("Processes by status",
                       "Unfinished processes by kind and status (processes_active): pending (not started yet), "
                       "running (a worker holds the lease), waiting (backoff before a retry), compensating, "
                       "manual_review. Paused processes keep their status.",
                       targets((active, "{{kind}} {{status}}")), stack=True),
            timeseries("Processes finished",
                       "Processes reaching a final or review status per second (processes_finished_total): "
                       "succeeded, failed (nothing to undo), compensated (earlier effects undone), manual_review.",
                       targets((f"sum by (kind, status) (rate(processes_finished_total{{{k}}}[{RI}]))",
                                "{{kind}} {{status}}")),
                       unit="ops", stack=True),
            timeseries("Start to finish latency",
                       "p50 and p99 of process_latency_seconds from start to the final or review status, by kind "
                       "and status. Buckets end at 60 s (longer shows as 60 s).",
                       quantiles("process_latency_seconds", by="kind, status", selector=f"{{{k}}}", qs=(0.5, 0.99)),
                       unit="s"),
        ]),
        row("Steps"),
        (8, [
            timeseries("Step attempts by outcome",
                       "process_step_attempts_total per second by kind, step and outcome: succeeded (also found at "
                       "the remote after an unknown outcome), error (classified below; retried unless permanent), "
                       "failed (permanent, compensation follows), manual_review.",
                       targets((f"sum by (kind, step, outcome) (rate(process_step_attempts_total{{{k}}}[{RI}]))",
                                "{{kind}} {{step}} {{outcome}}")),
                       unit="ops", stack=True),
            timeseries("Step errors by class",
                       "Attempts that did not succeed, by error class: transient (retried with backoff), permanent "
                       "(no retry: compensate), unknown (the remote may have acted: retried with the same key, "
                       "queried by operation id, or sent to manual review).",
                       targets((f'sum by (kind, step, error_class) (rate(process_step_attempts_total{{{k},error_class!="none"}}[{RI}]))',
                                "{{kind}} {{step}} {{error_class}}")),
                       unit="ops"),
            timeseries("Step duration (p50, p99)",
                       "process_step_duration_seconds: one step attempt, by kind and step (an external step "
                       "includes the remote call).",
                       quantiles("process_step_duration_seconds", by="kind, step", selector=f"{{{k}}}", qs=(0.5, 0.99)),
                       unit="s"),
        ]),
        (8, [
            heatmap("Step duration (heatmap)", "process_step_duration_seconds of the selected kinds, all steps.",
                    f"process_step_duration_seconds_bucket{{{k}}}"),
            heatmap("Start to finish latency (heatmap)", "process_latency_seconds of the selected kinds, all final "
                    "statuses.", f"process_latency_seconds_bucket{{{k}}}"),
        ]),
        row("Unknown outcomes and manual review"),
        (8, [
            timeseries("Unknown outcomes by resolution",
                       "process_unknown_outcomes_total per interval by kind, step and how the outcome is resolved: "
                       "retry_with_key (the remote honours idempotency keys: same key again), query (asked by "
                       "operation id first), manual_review (neither, or the query was inconclusive: a person "
                       "decides). Alerts: ProcessUnknownOutcomeNeedsReview, ProcessUnknownOutcomesUnresolved.",
                       targets((f"sum by (kind, step, resolution) (increase(process_unknown_outcomes_total{{{k}}}[{RI}]))",
                                "{{kind}} {{step}} {{resolution}}")),
                       draw="bars"),
            timeseries("Manual review backlog",
                       "Processes in manual_review, in total (process_manual_review_backlog) and per kind "
                       "(processes_active).",
                       targets(("max(process_manual_review_backlog)", "all kinds"),
                               (f'max by (kind) (processes_active{{{k},status="manual_review"}})', "{{kind}}"))),
            timeseries("Oldest in manual review",
                       "Age of the oldest process in manual_review; the line is the 1 h alert threshold "
                       "(ProcessManualReviewAgeHigh).",
                       targets(("max(process_manual_review_oldest_age_seconds)", "oldest")), unit="s",
                       threshold_steps=[(None, "green"), (3600, "red")]),
        ]),
        row("Workers and leases"),
        (8, [
            timeseries("Claims and lease takeovers",
                       "Processes claimed per second (process_claims_total, all kinds) and claims that took over "
                       "another worker's expired lease (process_lease_takeovers_total): a burst after a worker "
                       "died is expected; lasting takeovers fire ProcessLeaseTakeoversSpiking.",
                       targets((f"sum(rate(process_claims_total[{RI}]))", "claims (all kinds)"),
                               (f"sum by (kind) (rate(process_lease_takeovers_total{{{k}}}[{RI}]))", "{{kind}} takeovers")),
                       unit="ops"),
            timeseries("Fenced writes",
                       "Writes refused per interval because the worker's lease had been taken over "
                       "(process_fenced_writes_total): a worker that was paused or cut off came back too late. "
                       "Its work is discarded; the new holder redoes the step. Alert: ProcessFencedWrites.",
                       targets((f"sum by (kind) (increase(process_fenced_writes_total{{{k}}}[{RI}]))", "{{kind}}")),
                       draw="bars"),
            timeseries("Due processes of unknown versions",
                       "Due processes of a definition version a worker does not have, per worker, kind and version "
                       "(process_unknown_version_due): that worker leaves them alone. Lasting 10 min fires "
                       "ProcessDefinitionVersionUnknown.",
                       targets((f"process_unknown_version_due{{{k}}}", "{{instance}} {{kind}} v{{version}}"))),
            timeseries("Workers reporting",
                       "Process workers whose metrics Prometheus scrapes (each refreshes the manual-review gauges "
                       "every few seconds).",
                       targets(("count(count by (instance) (process_manual_review_backlog)) or vector(0)", "workers")),
                       legend_calcs=("lastNotNull", "min")),
        ]),
        row("Dependencies"),
        (7, [
            timeseries("Dependency circuits and waiting steps",
                       "Each dependency's shared circuit (dependency_circuit_state: 0 closed, 1 half open, 2 open; "
                       "max over the workers, which all read the same row), how long it has been down "
                       "(dependency_open_seconds, right axis in the legend) and the steps waiting for it "
                       "(process_steps_waiting). Waiting steps spend no attempts; they resume oldest first at the "
                       "dependency's resume rate when a probe gets through. Alert: DependencyDown.",
                       targets(("max by (dependency) (dependency_circuit_state)", "{{dependency}} circuit"),
                               ("max by (dependency) (process_steps_waiting)", "{{dependency}} steps waiting"),
                               ("max by (dependency) (dependency_open_seconds)", "{{dependency}} down for (s)"))),
            timeseries("Calls to dependencies",
                       "Calls made, by what the answer said of the remote's health (dependency_calls_total: "
                       "answered, unavailable, no_answer), and calls the circuit or the limits kept back "
                       "(dependency_calls_refused_total: open, probing, forced_open, rate_limited, saturated). While "
                       "a remote is down, the made calls should fall to about one probe a cool-down.",
                       targets((f"sum by (dependency, outcome) (rate(dependency_calls_total[{RI}]))",
                                "{{dependency}} {{outcome}}"),
                               (f"sum by (dependency, reason) (rate(dependency_calls_refused_total[{RI}]))",
                                "{{dependency}} kept back: {{reason}}")),
                       unit="ops"),
            timeseries("Dependency limits and paused consumers",
                       "Each dependency's limits across all instances: concurrency slots held "
                       "(dependency_slots_in_use) against the cap (dependency_slots), tokens in the rate "
                       "limit's bucket (dependency_rate_tokens; 0 means callers wait for the limit), and consumer "
                       "workers that stopped taking deliveries because every handler's dependency holds calls "
                       "back (consumer_paused_workers; the backlog stays in the queue).",
                       targets(("max by (dependency) (dependency_slots_in_use)", "{{dependency}} slots held"),
                               ("max by (dependency) (dependency_slots)", "{{dependency}} slots (cap)"),
                               ("min by (dependency) (dependency_rate_tokens)", "{{dependency}} tokens"),
                               ("sum by (consumer) (consumer_paused_workers)", "{{consumer}} workers paused"))),
        ]),
        row("Reconciliation with the payment provider"),
        (7, [
            timeseries("Reconciliation mismatches",
                       "Open reconciliation cases by kind (reconciliation_unresolved: charged_not_recorded, "
                       "recorded_not_charged, amount_mismatch, pending_too_long), cases found and resolved per "
                       "interval (reconciliation_mismatches_found_total, ..._resolved_total), and payments pending "
                       "past the threshold (reconciliation_pending_too_long). Each case waits for a person: the job "
                       "never moves money. Alert: ReconciliationMismatchesUnresolved.",
                       targets(("max by (kind) (reconciliation_unresolved)", "open {{kind}}"),
                               (f"sum by (kind) (increase(reconciliation_mismatches_found_total[{RI}]))", "found {{kind}}"),
                               (f"sum by (kind) (increase(reconciliation_mismatches_resolved_total[{RI}]))", "resolved {{kind}}"),
                               ("max(reconciliation_pending_too_long)", "pending too long"))),
            timeseries("Oldest open case and last run",
                       "Age of the oldest open reconciliation case (alert at a day: "
                       "ReconciliationMismatchesUnresolved) and time since the last successful run (alert at an "
                       "hour: ReconciliationNotRunning).",
                       targets(("max(reconciliation_unresolved_oldest_age_seconds)", "oldest open case"),
                               ("time() - max(reconciliation_last_success_timestamp_seconds)", "since the last run")),
                       unit="s"),
        ]),
        row("Payment provider (simulator)"),
        (7, [
            timeseries("Charges by outcome",
                       "POST /charges answered by the payment provider simulator (provider_charges_total): succeeded, "
                       "declined (402), replayed (same Idempotency-Key: the stored charge again), key_mismatch "
                       "(same key, other body), unavailable (503 before charging, fault error_before_charge).",
                       targets((f"sum by (outcome) (rate(provider_charges_total[{RI}]))", "{{outcome}}")),
                       unit="ops", stack=True),
            timeseries("Faults injected",
                       "Faults the simulator injected by mode (provider_faults_injected_total; PROVIDER_FAULTS or "
                       "POST /admin/faults): error_before_charge, timeout_after_charge and reset_after_charge (the "
                       "caller sees an unknown outcome), slow, decline.",
                       targets((f"sum by (mode) (rate(provider_faults_injected_total[{RI}]))", "{{mode}}")),
                       unit="ops"),
            timeseries("Refunds by outcome",
                       "POST /refunds by outcome (provider_refunds_total): refunded, replayed, not_refundable, "
                       "not_found.",
                       targets((f"sum by (outcome) (rate(provider_refunds_total[{RI}]))", "{{outcome}}")),
                       unit="ops", stack=True),
        ]),
    ]
    return dashboard(
        "processes", "Processes: recoverable multi-step processes",
        "Processes by status, step attempts and errors, unknown outcomes, manual review, leases and fencing, "
        "and the payment provider simulator. See docs/operations.md and docs/processes.md.",
        layout(p),
        [variable("kind", "Kind", "label_values(processes_active, kind)")])


DASHBOARDS = {
    "outbox-overview.json": overview,
    "outbox-relay.json": relay,
    "outbox-consumer.json": consumer,
    "outbox-api.json": api,
    "processes.json": processes,
}


def render(build):
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv):
    out = pathlib.Path(argv[1]) if len(argv) > 1 else OUT
    out.mkdir(parents=True, exist_ok=True)
    for name, build in DASHBOARDS.items():
        (out / name).write_text(render(build))
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main(sys.argv)
