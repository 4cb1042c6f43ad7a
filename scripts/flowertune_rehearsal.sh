#!/usr/bin/env bash
# The FlowerTune LLM general-NLP track rehearsed on a CPU (docs/flowertune.md): its preset,
# conf/flowertune-general-nlp.toml, on the track's 20 simulated SuperNodes, with the offline
# SmolLM2-135M (florg assets fetch --all) for Mistral-7B, a 100-row Alpaca-format file
# (scripts/data/alpaca-rehearsal.jsonl) for the Hub's data set, no 4-bit base (CUDA only),
# 2 rounds of 2 local steps over short examples; leaderboard=false lifts the checks these
# changes break. It ends, as a leaderboard run does, with <OUT>/flowertune-rehearsal/submission/.
#   bash scripts/flowertune_rehearsal.sh [OUT_DIR] [extra launcher arguments]
# OUT_DIR defaults to outputs; FLOWERTUNE_FLWR_HOME (default: a fresh temporary folder,
# removed at the end) holds the 20-SuperNode connection.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-outputs}"
shift || true
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
home="${FLOWERTUNE_FLWR_HOME:-}"
if [ -z "$home" ]; then
  home="$(mktemp -d "${TMPDIR:-/tmp}/flowertune-home-XXXXXX")"
  trap 'rm -rf "$home"' EXIT  # nothing of the rehearsal is left in the temporary folder
fi
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
python -m florg_tools.flwr_home setup --flwr-home "$home" --num-supernodes 20 >/dev/null
python -m florg_tools.launch --flwr-home "$home" --ephemeral-superlink \
    --preset flowertune-general-nlp \
    --set leaderboard=false --set model=SmolLM2-135M \
    --set data-path="$PWD/scripts/data/alpaca-rehearsal.jsonl" \
    --set num-server-rounds=2 --set quantization=none --set precision=fp32 \
    --set gradient-checkpointing=false --set local-steps=2 --set batch-size=2 \
    --set max-seq-length=96 --set max-eval-examples=8 --set eval-batch-size=8 \
    --set output-dir="$out" --set run-name=flowertune-rehearsal "$@"
