#!/usr/bin/env bash
# The straggler comparison under the virtual clock: sync, sync with over-selection and
# async at matched client work, a quarter of the nodes 5x slower and a log-normal arm
# (lab/grids/stragglers-virtual.yaml, stragglers-virtual-lognormal.yaml; docs/async.md),
# run at one fixed commit in a worktree of its own, resumable across sittings (published
# runs are copied back and skipped); and its publication under lab/evidence/stragglers-virtual/
# with each grid's report (python -m florg_lab.stragglers) and plot.
#
# Each grid in two steps: seed 0's async runs at every candidate server rate first (the
# grid's *-async-tuning blocks), the rate chosen per method on validation (python -m
# florg_lab.stragglers RUNS --choose-rate, with this repository's lab; recorded in the
# worktree's results/GRID/server-rate.json) and written over the CHOSEN-RATE placeholder
# of the worktree's copy of the grid, then the whole grid.
# Wall clock is not the measure (the rows do not depend on the machine's load): with
# SHARE_MACHINE=1 it runs beside another runner under ROOT, skipping the runners' lock
# (only beside grids whose measure is not the wall clock either).
#
#   bash lab/scripts/evidence_stragglers_virtual.sh [ROOT]                 # prepare ROOT/stragglers-virtual, run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_stragglers_virtual.sh ROOT   # publish, report, plot
#   GRIDS="stragglers-virtual" bash lab/scripts/evidence_stragglers_virtual.sh ROOT   # one of the grids
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
REPO=$(pwd)
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
VIRTUAL_COMMIT=c8e5c94  # virtual-clock: node profiles, virtual finish order, virtual-seconds
read -r -a GRIDS <<< "${GRIDS:-stragglers-virtual stragglers-virtual-lognormal}"
PUBLISHED=lab/evidence/stragglers-virtual  # runs/<grid>/<run>: config, metrics, summary
DIR="$ROOT/stragglers-virtual"
RATES=(0.5 1.0 2.0)  # the *-async-tuning blocks' async-server-lr values
. lab/scripts/fixed_worktree.sh

# choose_rate GRID: seed 0's async runs' choice per method, written over the CHOSEN-RATE
# placeholders of DIR's copy of the grid; fails when a method has none (a run unfinished).
choose_rate() {
  local grid=$1 method rate file="$DIR/lab/grids/$1.yaml"
  # from this repository (its lab and app: the worktree's folder would shadow them)
  (cd "$REPO" && .venv/bin/python -m florg_lab.stragglers "$DIR/results/$grid/runs" \
    --choose-rate "${RATES[@]}" --write "$DIR/results/$grid/server-rate.json") \
    > "$DIR/results/$grid/server-rate.txt"
  while read -r method rate; do
    sed -i -E "s/^( *async-server-lr: )\[[^]]*\](  # CHOSEN-RATE $method)\$/\1[$rate]\2/" "$file"
    grep -q "async-server-lr: \[$rate\]  # CHOSEN-RATE $method\$" "$file" \
      || { echo "choose_rate: no CHOSEN-RATE $method line in $file" >&2; exit 2; }
    echo "choose_rate: $grid: $method at async-server-lr $rate"
  done < "$DIR/results/$grid/server-rate.txt"
}

if [ -n "${PUBLISH_ONLY:-}" ]; then
  publish_grids "$DIR" "$PUBLISHED" "${GRIDS[@]}"
  [ ! -f .venv/bin/activate ] || . .venv/bin/activate  # the report reads with the repo's lab
  for grid in "${GRIDS[@]}"; do
    [ ! -f "$DIR/results/$grid/server-rate.json" ] \
      || cp "$DIR/results/$grid/server-rate.json" "$PUBLISHED/$grid-server-rate.json"
    python -m florg_lab.stragglers "$PUBLISHED/runs/$grid" --plot "$PUBLISHED/$grid.png" \
      | tee "$PUBLISHED/$grid-report.md"
  done
  exit 0
fi
fixed_worktree "$DIR" "$VIRTUAL_COMMIT"
copy_grids "$DIR" "$PUBLISHED" "${GRIDS[@]}"
[ -z "${PREPARE_ONLY:-}" ] || exit 0
[ -z "${SHARE_MACHINE:-}" ] || export FLORG_GRID_LOCK_HELD=1  # the lock is not taken
hold_grid_lock "$ROOT"
enter_worktree "$DIR"
python -m florg_tools.assets fetch
for grid in "${GRIDS[@]}"; do
  # the runner's --only keeps the runs whose id holds this: seed 0's async runs
  python -m "$(grid_runner)" run "$grid" --no-report --only "round-mode=async,seed=0,"
  choose_rate "$grid"
  python -m "$(grid_runner)" run "$grid" --no-report
done
