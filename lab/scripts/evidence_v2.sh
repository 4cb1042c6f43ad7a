#!/usr/bin/env bash
# The protocol-v2 evidence grids (issue 27), each task's at one fixed commit, resumable
# across sittings.
#
#   bash lab/scripts/evidence_v2.sh [ROOT]                # prepare ROOT/v2, ROOT/v2-snli (default ../florg-evidence), run
#   PREPARE_ONLY=1 bash lab/scripts/evidence_v2.sh ROOT   # prepare only
#   TASKS="movie-sentiment snli" bash lab/scripts/evidence_v2.sh ROOT   # which tasks (default: both)
#
# Each task's grids run in a worktree of their own, checked out at the commit every one of
# their runs ran at (lab/scripts/evidence_v2_layout.sh), with its own .venv (the grid files
# are data, copied from this checkout):
#   movie-sentiment: ROOT/v2 at V2_COMMIT (finished there);
#   snli: ROOT/v2-snli at V2_SNLI_COMMIT, fixed before its first run. It is later than
#     V2_COMMIT so that its runs record their machine and the grid its commit (the 2-core
#     machine changed CPU between sessions); FLoRG's training differs from V2_COMMIT's only
#     by float32 rounding (factors formed per group of layers, 42f1937), the baselines' not.
#     A verdict pairs methods within one task, so within one commit.
# Runs already published under lab/evidence/evidence-v2/ are copied into the worktree's
# results/ first, so the runner skips them (runs are deterministic). Per task, in this
# order (each step resumes):
#   1. FLoRG and FedIT of the main grid (the verdict's first rows);
#   2. the FLoRG variants (plain FLoRG's runs are copied in from step 1, not rerun);
#   3. the rest of the main grid, one method at a time (florg-signed, FeDeRA, FedEx-LoRA,
#      FFA-LoRA, FedSA-LoRA: each one's tuning, then its seeds).
# Publish what has finished, both tasks in one report, from this checkout with
#   bash lab/scripts/publish_evidence_v2.sh ROOT
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
. lab/scripts/evidence_v2_layout.sh  # V2_COMMIT, V2_SNLI_COMMIT, grids_of, worktree_of
TASKS="${TASKS:-$V2_TASKS}"
PUBLISHED=$V2_PUBLISHED
. lab/scripts/fixed_worktree.sh

for task in $TASKS; do
  read -r dir commit <<<"$(worktree_of "$task")"
  fixed_worktree "$dir" "$commit"
  for grid in $(grids_of "$task"); do
    cp "lab/grids/$grid.yaml" "$dir/conf/grids/"
    out="$dir/results/$grid"
    mkdir -p "$out/runs"
    [ ! -d "$PUBLISHED/runs/$grid" ] || cp -rn "$PUBLISHED/runs/$grid/." "$out/runs/"
  done
done
[ -z "${PREPARE_ONLY:-}" ] || exit 0

home=$PWD
for task in $TASKS; do
  read -r dir _ <<<"$(worktree_of "$task")"
  read -r main variants <<<"$(grids_of "$task")"
  enter_worktree "$dir"
  python -m florg_tools.assets fetch
  python -m "$(grid_runner)" run "$main" --no-report --only method=florg, method=fedit,
  # plain FLoRG's finished runs have the variants grid's ids and settings: reuse them
  for run in results/"$main"/runs/*method=florg,*; do
    [ -d "$run" ] && [ ! -e "results/$variants/runs/$(basename "$run")" ] \
      && cp -r "$run" "results/$variants/runs/"
  done
  python -m "$(grid_runner)" run "$variants" --no-report
  # one baseline at a time, its tuning then its seeds, so that each verdict row completes in turn
  for method in florg-signed federa fedex-lora ffa-lora fedsa-lora; do
    python -m "$(grid_runner)" run "$main" --no-report --only "method=$method,"
  done
  python -m "$(grid_runner)" run "$main" --no-report
  deactivate
  cd "$home"
done
