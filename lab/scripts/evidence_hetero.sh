#!/usr/bin/env bash
# The clients-of-different-rank evidence (issue 30: lab/grids/hetero.yaml, with the
# homogeneous references of lab/grids/hetero-references.yaml) at one fixed commit,
# resumable across sittings.
#
#   bash lab/scripts/evidence_hetero.sh [ROOT]               # prepare ROOT/hetero (default ../florg-evidence), run
#   PREPARE_ONLY=1 bash lab/scripts/evidence_hetero.sh ROOT  # prepare only
#   DIAGNOSTICS=1 bash lab/scripts/evidence_hetero.sh ROOT   # then lab/grids/hetero-diagnostics.yaml
#
# The worktree ROOT/hetero is checked out at HETERO_COMMIT (below: fixed once the first
# hetero run is published) with its own .venv; the grid files are data, copied from this
# checkout. Runs already published under lab/evidence/hetero/ are copied in first, so the
# runner skips them.
#
# The references reuse protocol v2's runs: hetero-references' settings are evidence-v2's
# (movie sentiment; florg and fedit, every client at rank 4), and the homogeneous path of
# HETERO_COMMIT reproduces evidence-v2's commit 34820fb row for row on every metric both
# record (`python scripts/compare_homogeneous.py --base 34820fb --method florg|fedit`: the tiny
# model's 2-round simulation; HETERO_COMMIT adds update-norm-median/max), so the published
# evidence-v2 florg and fedit runs are copied
# into results/hetero-references/ and the runner finds them finished (config.json agrees with
# every setting the grid names). Then, one arm at a time (its tuning, then its seeds):
# florg (heterogeneous), hetlora, flexlora.
# Publish what has finished from this checkout with (see docs/results.md):
#   florg experiments evidence hetero --out ROOT/hetero/results/hetero \
#       --with hetero-references=ROOT/hetero/results/hetero-references --publish lab/evidence/hetero
# (the references' labels carry hetero-references.yaml's report.label, "(homogeneous r = 4)").
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
HETERO_COMMIT=2afb3fb
ROOT="${1:-../florg-evidence}"
PUBLISHED=lab/evidence/hetero
REUSED=lab/evidence/evidence-v2/runs/evidence-v2
dir="$ROOT/hetero"
mkdir -p "$ROOT"
. lab/scripts/fixed_worktree.sh
fixed_worktree "$dir" "$HETERO_COMMIT"

for grid in hetero hetero-references hetero-diagnostics; do
  cp "lab/grids/$grid.yaml" "$dir/conf/grids/"
  mkdir -p "$dir/results/$grid/runs"
  [ ! -d "$PUBLISHED/runs/$grid" ] || cp -rn "$PUBLISHED/runs/$grid/." "$dir/results/$grid/runs/"
done
for run in "$REUSED"/*method=florg,*task=movie-sentiment "$REUSED"/*method=fedit,*task=movie-sentiment; do
  [ -d "$run" ] && cp -rn "$run" "$dir/results/hetero-references/runs/"
done
[ -z "${PREPARE_ONLY:-}" ] || exit 0

enter_worktree "$dir"
python -m florg_tools.assets fetch
# the references: every run reused (a run the grid still lists as missing runs here)
python -m "$(grid_runner)" run hetero-references --no-report
for method in florg hetlora flexlora; do
  python -m "$(grid_runner)" run hetero --no-report --only "method=$method,"
done
[ -n "${DIAGNOSTICS:-}" ] || exit 0

# hetero-diagnostics: its (procrustes, semi-orthogonal) runs are hetero's florg seeds 0 and 1
# at the tuned 5e-4 (every setting the same), copied under the diagnostic grid's run names
diag="$dir/results/hetero-diagnostics/runs"
for seed in 0 1; do
  target="$diag/projection-init=semi-orthogonal,rank-mismatch=procrustes,seed=$seed"
  [ -d "$target" ] || cp -r "$dir/results/hetero/runs/learning-rate=0.0005,method=florg,seed=$seed,task=movie-sentiment" "$target"
done
python -m "$(grid_runner)" run hetero-diagnostics --no-report
