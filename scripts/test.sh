#!/usr/bin/env bash
# Runs every test against real PostgreSQL and RabbitMQ (started here when they are down).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
# Child-process tests (SIGKILL a relay or a consumer) need the binaries next to the test executables.
cargo build --workspace --bins
# A process worker embedded in an application pulls neither lapin nor axum nor OpenTelemetry
# through plumbing (its light modules build without the default features). Workspace feature
# unification would hide a light module that starts using a heavy one; these two catch it.
cargo build -p plumbing --no-default-features
if cargo tree -p processes -e normal | grep -E ' (lapin|axum|opentelemetry[a-z_-]*) v'; then
    echo "processes pulls a heavy dependency through plumbing (above)" >&2
    exit 1
fi
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast "$@"
else
    cargo test --workspace --no-fail-fast "$@"
fi
