#!/usr/bin/env bash
# The long fault campaign: 100,000 messages through a private 3-node RabbitMQ cluster and a private
# PostgreSQL while broker nodes, relays and consumers are SIGKILLed and links cut (see
# tests/tests/system/fault_campaign.rs). Needs root (it starts rabbitmq-server and postgres as their users).
#   scripts/fault-campaign.sh                 # 100,000 messages, random seed (printed)
#   FAULT_SEED=42 scripts/fault-campaign.sh   # replay a campaign
#   FAULT_MESSAGES=20000 FAULT_ROUNDS=20 scripts/fault-campaign.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins
export FAULT_MESSAGES="${FAULT_MESSAGES:-100000}"
export FAULT_ROUNDS="${FAULT_ROUNDS:-40}"
export FAULT_MAX_BROKER_KILLS="${FAULT_MAX_BROKER_KILLS:-1000}"
cargo nextest run -p system-tests -E 'test(/^fault_campaign::/)' --no-capture
