#!/usr/bin/env bash
# Deployment on real Flower processes (docs/deploy-superlink.md).
#
#   bash scripts/deploy_local.sh [up options]      # SuperLink + 3 SuperNodes here, TLS; Ctrl-C stops
#   bash scripts/deploy_local.sh up --nodes 2 --node-auth --host 0.0.0.0 --san 192.168.1.10
#   bash scripts/deploy_local.sh up --nodes 3 --node-ranks 2,4,8   # each node's adapter rank
#   bash scripts/deploy_local.sh superlink --certs certs --host 0.0.0.0 --port 9093   # server machine
#   bash scripts/deploy_local.sh node --superlink 192.168.1.10:9093 --partition-id 0 \
#        --num-partitions 2 --root-certificates certs/ca.crt [--data-path my-data] [--rank 8]  # client
#   bash scripts/deploy_local.sh connection --name lan --address 192.168.1.10:9093 \
#        --root-certificates certs/ca.crt                                           # CLI machine
#   bash scripts/deploy_local.sh certs --out certs --san 192.168.1.10 [--node-keys 2]
#
# Then: FLWR_HOME=... flwr run . NAME --stream   (or python -m florg_tools.launch --connection NAME)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
case "${1:-}" in
  up|superlink|node|connection|certs) exec python -m florg_tools.deploy "$@" ;;
  -h|--help) exec python -m florg_tools.deploy --help ;;
  *) exec python -m florg_tools.deploy up --nodes 3 "$@" ;;
esac
