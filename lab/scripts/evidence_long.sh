#!/usr/bin/env bash
# The long-budget SNLI grid (lab/grids/evidence-long-snli.yaml), run at one fixed commit
# in a worktree of its own, resumable across sittings; and its publication.
#
#   bash lab/scripts/evidence_long.sh [ROOT]            # prepare ROOT/long-snli (default ../florg-evidence), run
#   PREPARE_ONLY=1 bash lab/scripts/evidence_long.sh ROOT
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_long.sh ROOT   # copy finished runs to $PUBLISHED
#
# The worktree is checked out at LONG_COMMIT, with its own .venv; the grid file is data,
# copied from this checkout. Runs already published under $PUBLISHED are copied into the
# worktree's results first, so the runner skips them (runs are deterministic). Order: FLoRG
# and FedIT (tuning, then seeds: the first verdict row), then FeDeRA.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
LONG_COMMIT=9fbaebe          # the runtime every run of this grid ran at
GRID=evidence-long-snli
PUBLISHED=lab/evidence/long-snli  # config, metrics and summary of each finished run; tuning.json
. lab/scripts/fixed_worktree.sh
dir="$ROOT/long-snli"
out="$dir/results/$GRID"

if [ -n "${PUBLISH_ONLY:-}" ]; then
  mkdir -p "$PUBLISHED/runs"
  for run in "$out"/runs/*/; do
    grep -qs '"status": *"finished"' "$run/summary.json" || continue  # unfinished or failed
    dest="$PUBLISHED/runs/$(basename "$run")"
    mkdir -p "$dest"
    cp "$run"/config.json "$run"/metrics.jsonl "$run"/summary.json "$dest/"
  done
  [ ! -f "$out/tuning.json" ] || cp "$out/tuning.json" "$PUBLISHED/tuning.json"
  echo "evidence_long: $(ls "$PUBLISHED/runs" | wc -l) finished runs in $PUBLISHED"
  exit 0
fi

fixed_worktree "$dir" "$LONG_COMMIT"
cp "lab/grids/$GRID.yaml" "$dir/conf/grids/"
mkdir -p "$out/runs"
[ ! -d "$PUBLISHED/runs" ] || cp -rn "$PUBLISHED/runs/." "$out/runs/"
[ -n "${PREPARE_ONLY:-}" ] && exit 0

hold_grid_lock "$ROOT"
enter_worktree "$dir"
python -m florg_tools.assets fetch
python -m "$(grid_runner)" run "$GRID" --no-report --only method=florg, method=fedit,
python -m "$(grid_runner)" run "$GRID" --no-report
