#!/usr/bin/env bash
# The evidence grids (issue 11), each at the commit its published runs were made at,
# resumable across sittings.
#
#   bash lab/scripts/evidence_grid.sh [ROOT]               # prepare ROOT (default ../florg-evidence), run
#   PREPARE_ONLY=1 bash lab/scripts/evidence_grid.sh ROOT  # prepare only
#
# A grid's commit is fixed once its first run is published (GRIDS below, in run order):
#   evidence, evidence-ablations  f8959ae  (before the issue-14 redesign; module paths
#                                           flower_app.experiments)
#   evidence-fedsa, evidence-snli 4f4c5b1  (FedSA-LoRA scored by its clients'
#                                           personalised models; eval-every)
# Each commit gets a git worktree ROOT/<commit> with its own .venv. The grid files are
# data, copied from this checkout (the f8959ae one lists FedSA-LoRA, which moved to
# evidence-fedsa). Runs already published under lab/evidence/evidence/ are copied into the
# worktree's results/ first, so the runner skips them. Publish what has finished from this
# checkout with:
#   florg experiments evidence evidence --out ROOT/f8959ae/results/evidence \
#       --with evidence-fedsa=ROOT/<new>/results/evidence-fedsa ... \
#       --publish lab/evidence/evidence
# (or see lab/evidence/evidence/NOTES.md, "Continuing the grids").
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
EVIDENCE_OLD=f8959ae
EVIDENCE_NEW=4f4c5b1
GRIDS=(
  "evidence $EVIDENCE_OLD flower_app.experiments"
  "evidence-fedsa $EVIDENCE_NEW florg_tools.experiments"
  "evidence-ablations $EVIDENCE_OLD flower_app.experiments"
  "evidence-snli $EVIDENCE_NEW florg_tools.experiments"
)
ROOT="${1:-../florg-evidence}"
PUBLISHED=lab/evidence/evidence
mkdir -p "$ROOT"

. lab/scripts/fixed_worktree.sh
for commit in $EVIDENCE_OLD $EVIDENCE_NEW; do  # each commit's worktree with its .venv
  fixed_worktree "$ROOT/$commit" "$commit"
done
for entry in "${GRIDS[@]}"; do
  read -r grid commit _ <<<"$entry"
  dir="$ROOT/$commit"
  cp "lab/grids/$grid.yaml" "$dir/conf/grids/"
  out="$dir/results/$grid"
  mkdir -p "$out/runs"
  if [ -d "$PUBLISHED/runs/$grid" ]; then
    cp -rn "$PUBLISHED/runs/$grid/." "$out/runs/"
  fi
  [ ! -f "$PUBLISHED/$grid-tuning.json" ] || cp "$PUBLISHED/$grid-tuning.json" "$out/tuning.json"
  [ ! -f "$PUBLISHED/$grid-centralised.json" ] \
    || cp "$PUBLISHED/$grid-centralised.json" "$out/centralised.json"
done
[ -z "${PREPARE_ONLY:-}" ] || exit 0

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
for entry in "${GRIDS[@]}"; do
  read -r grid commit module <<<"$entry"
  (
    cd "$ROOT/$commit"
    . .venv/bin/activate
    python -m "${module%.experiments}.assets" fetch
    python -m "$module" run "$grid" --no-report
  )
done
