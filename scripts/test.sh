#!/usr/bin/env bash
# Runs every test against real PostgreSQL and RabbitMQ (started here when they are down).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
# Child-process tests (SIGKILL a relay or a consumer) need the binaries next to the test executables.
cargo build --workspace --bins
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast "$@"
else
    cargo test --workspace --no-fail-fast "$@"
fi
