#!/usr/bin/env bash
# The exact-aggregation methods' evidence: their decoder check (lab/grids/decoder-check.yaml)
# and protocol v2 (lab/grids/evidence-v2-exact.yaml, movie sentiment, and
# evidence-v2-exact-snli.yaml), run at one fixed commit in a worktree of their own,
# resumable across sittings; and their publication.
#
#   bash lab/scripts/evidence_exact.sh [ROOT]                  # prepare ROOT/v2-exact, run
#   PREPARE_ONLY=1 bash lab/scripts/evidence_exact.sh ROOT    # the worktree ready, nothing run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_exact.sh ROOT    # finished runs and reports to $PUBLISHED
#   GRIDS="decoder-check" bash lab/scripts/evidence_exact.sh ROOT   # a subset of the grids
#
# Runs already published under $PUBLISHED are copied into the worktree's results first, so
# the runner skips them. Order: the decoder check (six runs of 5-50 min), then movie
# sentiment (each method's tuning, then its seeds), then SNLI. lab/scripts/evidence_queue.sh
# runs these first, then the privacy grids: they share the 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
EXACT_COMMIT=f9c930c  # the runtime every run of these grids runs at
read -r -a GRIDS <<< "${GRIDS:-decoder-check evidence-v2-exact evidence-v2-exact-snli}"
PUBLISHED=lab/evidence/evidence-v2-exact  # runs/<grid>/<run>: config, metrics, summary; tuning;
# decoder-check/: the decoder check's report, plots and runs/<run>
. lab/scripts/fixed_worktree.sh
dir="$ROOT/v2-exact"
results="$dir/results"

finished_in() {  # GRID: whether the worktree holds a finished run of GRID
  grep -qsl '"status": *"finished"' "$results/$1"/runs/*/summary.json
}

if [ -n "${PUBLISH_ONLY:-}" ]; then
  # The reports, written by this checkout's code: the decoder check's (its own folder:
  # results.md, plots, runs) and protocol v2's evidence report (README.md and summary.json,
  # the file the verdict page reads, in evidence-v2's schema), both tasks in one.
  # This checkout's environment (matplotlib, the report code), whatever shell runs this.
  [ ! -x .venv/bin/python ] || PATH="$PWD/.venv/bin:$PATH"
  v2_grids=()
  decoder=""
  for grid in "${GRIDS[@]}"; do
    if [ "$grid" = decoder-check ]; then decoder=1; else v2_grids+=("$grid"); fi
  done
  [ ${#v2_grids[@]} -eq 0 ] || publish_grids "$dir" "$PUBLISHED" "${v2_grids[@]}"
  if [ -n "$decoder" ] && finished_in decoder-check; then
    python -m "$(grid_runner)" report decoder-check --out "$results/decoder-check" \
      --publish "$PUBLISHED/decoder-check"
  fi
  if finished_in evidence-v2-exact; then
    with=()
    ! finished_in evidence-v2-exact-snli \
      || with=(--with "evidence-v2-exact-snli=$results/evidence-v2-exact-snli")
    python -m "$(grid_runner)" evidence evidence-v2-exact \
      --out "$results/evidence-v2-exact" "${with[@]}" --publish "$PUBLISHED"
  fi
  exit 0
fi
run_grid_set "$dir" "$EXACT_COMMIT" "$PUBLISHED" "${GRIDS[@]}"
