#!/usr/bin/env bash
# The protocol-v2 evidence grids (issue 27) at one fixed commit, resumable across sittings.
#
#   bash scripts/evidence_v2.sh [ROOT]                # prepare ROOT/v2 (default ../florg-evidence), run
#   PREPARE_ONLY=1 bash scripts/evidence_v2.sh ROOT   # prepare only
#   TASKS="movie-sentiment snli" bash scripts/evidence_v2.sh ROOT   # which tasks (default: both)
#
# The worktree ROOT/v2 is checked out at V2_COMMIT (below: the code every v2 run ran at,
# fixed once the first v2 run was published) with its own .venv; the grid files are data,
# copied from this checkout. Runs already published under docs/results/evidence-v2/
# are copied into the worktree's results/ first, so the runner skips them (runs are
# deterministic). Per task, in this order (each step resumes):
#   1. FLoRG and FedIT of the main grid (the verdict's first rows);
#   2. the FLoRG variants (plain FLoRG's runs are copied in from step 1, not rerun);
#   3. the rest of the main grid, one method at a time (florg-signed, FeDeRA, FedEx-LoRA,
#      FFA-LoRA, FedSA-LoRA: each one's tuning, then its seeds).
# Publish what has finished from this checkout with (see docs/results.md):
#   florg experiments evidence evidence-v2 --out ROOT/v2/results/evidence-v2 \
#       --with evidence-v2-variants=ROOT/v2/results/evidence-v2-variants \
#       --publish docs/results/evidence-v2
set -euo pipefail
cd "$(dirname "$0")/.."
V2_COMMIT=34820fb
ROOT="${1:-../florg-evidence}"
TASKS="${TASKS:-movie-sentiment snli}"
PUBLISHED=docs/results/evidence-v2
dir="$ROOT/v2"
mkdir -p "$ROOT"
. scripts/fixed_worktree.sh
fixed_worktree "$dir" "$V2_COMMIT"

grids_of() {  # task -> its main grid and variants grid
  case "$1" in
    movie-sentiment) echo "evidence-v2 evidence-v2-variants" ;;
    snli) echo "evidence-v2-snli evidence-v2-snli-variants" ;;
    *) echo "evidence_v2: unknown task $1" >&2; exit 2 ;;
  esac
}

for task in $TASKS; do
  for grid in $(grids_of "$task"); do
    cp "conf/grids/$grid.yaml" "$dir/conf/grids/"
    out="$dir/results/$grid"
    mkdir -p "$out/runs"
    [ ! -d "$PUBLISHED/runs/$grid" ] || cp -rn "$PUBLISHED/runs/$grid/." "$out/runs/"
  done
done
[ -z "${PREPARE_ONLY:-}" ] || exit 0

enter_worktree "$dir"
python -m florg_tools.assets fetch
for task in $TASKS; do
  read -r main variants <<<"$(grids_of "$task")"
  python -m florg_tools.experiments run "$main" --no-report --only method=florg, method=fedit,
  # plain FLoRG's finished runs have the variants grid's ids and settings: reuse them
  for run in results/"$main"/runs/*method=florg,*; do
    [ -d "$run" ] && [ ! -e "results/$variants/runs/$(basename "$run")" ] \
      && cp -r "$run" "results/$variants/runs/"
  done
  python -m florg_tools.experiments run "$variants" --no-report
  # one baseline at a time, its tuning then its seeds, so that each verdict row completes in turn
  for method in florg-signed federa fedex-lora ffa-lora fedsa-lora; do
    python -m florg_tools.experiments run "$main" --no-report --only "method=$method,"
  done
  python -m florg_tools.experiments run "$main" --no-report
done
