#!/usr/bin/env bash
# The straggler comparison: synchronous against buffered asynchronous rounds at matched
# client work (lab/grids/async-stragglers.yaml; docs/async.md), run at one fixed commit in a
# worktree of its own, resumable across sittings; and its publication under
# lab/evidence/async-stragglers/ with its report (python -m florg_lab.stragglers: the time
# to the synchronous run's final validation score, the test score at equal wall clock) and
# plot. Wall clock is the measure: run it alone.
#
#   bash lab/scripts/evidence_async.sh [ROOT]                 # prepare ROOT/async, run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_async.sh ROOT   # publish, report, plot
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
ASYNC_COMMIT=4f98db1  # round-mode=async, stragglers, a grid's ray-num-cpus
GRID=async-stragglers
PUBLISHED=lab/evidence/async-stragglers  # runs/<grid>/<run>: config, metrics, summary
. lab/scripts/fixed_worktree.sh
run_grid_set "$ROOT/async" "$ASYNC_COMMIT" "$PUBLISHED" "$GRID"
if [ -n "${PUBLISH_ONLY:-}" ]; then
  [ ! -f .venv/bin/activate ] || . .venv/bin/activate  # the report reads with the repo's lab
  python -m florg_lab.stragglers "$PUBLISHED/runs/$GRID" --plot "$PUBLISHED/stragglers.png" \
    | tee "$PUBLISHED/report.md"
fi
