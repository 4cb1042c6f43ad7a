#!/usr/bin/env bash
# The evidence grids (issue 11) at their fixed commit, resumable across sittings.
#
#   bash scripts/evidence_grid.sh [DIR]              # prepare DIR (default ../florg-evidence), run
#   PREPARE_ONLY=1 bash scripts/evidence_grid.sh DIR # prepare only; then `list` shows what is done
#
# The grids run from a git worktree of EVIDENCE_COMMIT (the commit every published evidence
# run was made at) with its own .venv. Runs already published under docs/results/evidence/
# are copied into the worktree's results/ first, so the runner skips them; then `evidence`,
# `evidence-ablations` and `evidence-snli` run in that order. Publish what has finished from
# this checkout with:
#   florg experiments evidence evidence --out DIR/results/evidence \
#       --publish docs/results/evidence
set -euo pipefail
cd "$(dirname "$0")/.."
EVIDENCE_COMMIT=f8959ae
DIR="${1:-../florg-evidence}"
PUBLISHED=docs/results/evidence
if [ ! -d "$DIR" ]; then
  git worktree add --detach "$DIR" "$EVIDENCE_COMMIT"
fi
[ "$(git -C "$DIR" rev-parse --short=7 HEAD)" = "$EVIDENCE_COMMIT" ] \
  || { echo "evidence_grid: $DIR is not at $EVIDENCE_COMMIT" >&2; exit 2; }
# The ablation grid was written after that commit; it is data for the runner, not code.
cp conf/grids/evidence-ablations.yaml "$DIR/conf/grids/"
for grid in evidence evidence-ablations evidence-snli; do
  out="$DIR/results/$grid"
  mkdir -p "$out/runs"
  if [ -d "$PUBLISHED/runs/$grid" ]; then
    cp -rn "$PUBLISHED/runs/$grid/." "$out/runs/"
  fi
  [ ! -f "$PUBLISHED/$grid-tuning.json" ] || cp "$PUBLISHED/$grid-tuning.json" "$out/tuning.json"
  [ ! -f "$PUBLISHED/$grid-centralised.json" ] \
    || cp "$PUBLISHED/$grid-centralised.json" "$out/centralised.json"
done
(cd "$DIR" && bash scripts/setup.sh)
[ -z "${PREPARE_ONLY:-}" ] || exit 0
cd "$DIR"
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
python -m flower_app.assets fetch
for grid in evidence evidence-ablations evidence-snli; do
  python -m flower_app.experiments run "$grid" --no-report
done
