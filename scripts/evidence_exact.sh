#!/usr/bin/env bash
# The exact-aggregation methods under protocol v2 (conf/grids/evidence-v2-exact.yaml, movie
# sentiment, and evidence-v2-exact-snli.yaml), run at one fixed commit in a worktree of their
# own, resumable across sittings; and their publication.
#
#   EXACT_COMMIT=<sha> bash scripts/evidence_exact.sh [ROOT]   # prepare ROOT/v2-exact, run
#   PREPARE_ONLY=1 ... / PUBLISH_ONLY=1 bash scripts/evidence_exact.sh ROOT
#
# EXACT_COMMIT: the runtime every run of these grids runs at. It is fixed (written below)
# when the first run is published; until then it must be given. Runs already published
# under $PUBLISHED are copied into the worktree's results first, so the runner skips them.
# Order: movie sentiment (each method's tuning, then its seeds), then SNLI. The long-budget
# grid (scripts/evidence_long.sh) goes first when both are due: it shares the 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
EXACT_COMMIT=${EXACT_COMMIT:?set EXACT_COMMIT to the commit the grids run at}
GRIDS=(evidence-v2-exact evidence-v2-exact-snli)
PUBLISHED=evidence/evidence-v2-exact  # runs/<grid>/<run>: config, metrics, summary; tuning
. scripts/fixed_worktree.sh
run_grid_set "$ROOT/v2-exact" "$EXACT_COMMIT" "$PUBLISHED" "${GRIDS[@]}"
