#!/usr/bin/env bash
# Starts the local PostgreSQL and RabbitMQ when they are not running, and waits until both answer.
set -euo pipefail

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
rabbit_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && rabbitmqctl -q await_startup >/dev/null 2>&1; }

if ! pg_up; then
    echo "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
if ! rabbit_up; then
    echo "starting RabbitMQ"
    rabbitmq-server -detached || true
fi
for _ in $(seq 1 120); do
    if pg_up && rabbit_up; then
        echo "PostgreSQL and RabbitMQ are up"
        exit 0
    fi
    sleep 1
done
echo "PostgreSQL or RabbitMQ did not come up within 120 s" >&2
exit 1
