#!/usr/bin/env bash
# README command 1: set up a fresh machine and run the main job (FLoRG on all-MiniLM-L6-v2
# with SNLI, 5 simulated clients, an IID split, the run settings of
# pyproject.toml) through the Flower simulation engine.  Extra arguments go to the
# launcher, e.g.:  bash scripts/quickstart.sh --set method=fedit
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m florg_tools.assets fetch                         # offline model + data, sha256-checked
python -m florg_tools.flwr_home setup --flwr-home "$PWD/.flwr_home" --num-supernodes 5  # the 'local-simulation' connection
export FLWR_HOME="$PWD/.flwr_home"
exec python -m florg_tools.launch --connection local-simulation --ephemeral-superlink "$@"
