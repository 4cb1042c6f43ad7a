#!/usr/bin/env bash
# Publish protocol v2's evidence (issue 27), both tasks in one report, to
# lab/evidence/evidence-v2/ (README.md, summary.json with a `tasks` entry per task, the
# tuning files, the plots, every finished run's config, metrics and summary).
#
#   bash lab/scripts/publish_evidence_v2.sh [ROOT]   # ROOT as for lab/scripts/evidence_v2.sh
#
# Each of the four grids (evidence-v2 and evidence-v2-variants: movie sentiment, run in
# ROOT/v2; evidence-v2-snli and evidence-v2-snli-variants: SNLI, run in ROOT/v2-snli)
# comes from its worktree's results folder when that exists, else from its published copy
# here (runs/<grid>/ and <grid>-tuning.json, staged under a temporary folder in the layout
# the runner writes): a grid that has finished and been published needs no worktree.
# Nothing runs; the report is written by `florg experiments evidence` from this checkout.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
. lab/scripts/evidence_v2_layout.sh  # V2_TASKS, V2_PUBLISHED, grids_of, worktree_of
PUBLISHED=$V2_PUBLISHED
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

source_of() {  # grid worktree -> the folder its runs and tuning.json are read from
  local grid=$1 worktree=$2
  if [ -d "$worktree/results/$grid/runs" ]; then
    echo "$worktree/results/$grid"
  elif [ -d "$PUBLISHED/runs/$grid" ]; then
    mkdir -p "$stage/$grid/runs"
    cp -r "$PUBLISHED/runs/$grid/." "$stage/$grid/runs/"
    [ ! -f "$PUBLISHED/$grid-tuning.json" ] \
      || cp "$PUBLISHED/$grid-tuning.json" "$stage/$grid/tuning.json"
    echo "$stage/$grid"
  fi
}

args=()  # the first grid found (movie sentiment's main grid) names the report
for task in $V2_TASKS; do
  read -r worktree _ <<<"$(worktree_of "$task")"
  for grid in $(grids_of "$task"); do
    folder=$(source_of "$grid" "$worktree")
    [ -n "$folder" ] || continue
    echo "publish_evidence_v2: $grid from $folder"
    if [ ${#args[@]} -eq 0 ]; then
      args=(evidence "$grid" --out "$folder")
    else
      args+=(--with "$grid=$folder")
    fi
  done
done
[ "${args[1]:-}" = evidence-v2 ] \
  || { echo "publish_evidence_v2: no runs of evidence-v2 found" >&2; exit 2; }
python -m florg_lab "${args[@]}" --publish "$PUBLISHED"
