#!/usr/bin/env bash
# Fed-SB's published rows rerun at the code where it trains its authors' model (scale s = 1,
# round 0 the pooled gradient; docs/architecture.md): protocol v2 on movie sentiment
# (conf/grids/fed-sb-s1-v2.yaml) and SNLI (fed-sb-s1-v2-snli.yaml), each its tuning, then its
# seeds, and a check outside the protocol at larger rates (fed-sb-s1-v2-rate-check.yaml: at
# s = 1 every protocol rate stayed at the majority class); run at one fixed commit in a
# worktree of their own, resumable across sittings; and
# their publication under evidence/fed-sb-s1/ (the runs at s = 4 stay where they were
# published, evidence/evidence-v2-exact and evidence/privacy-regimes, for comparison).
#
#   bash scripts/evidence_fed_sb.sh [ROOT]                 # prepare ROOT/fed-sb-s1, run
#   PUBLISH_ONLY=1 bash scripts/evidence_fed_sb.sh ROOT   # finished runs into evidence/fed-sb-s1
#   GRIDS="fed-sb-s1-v2" bash scripts/evidence_fed_sb.sh ROOT   # a subset of the grids
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
FED_SB_S1_COMMIT=d9539ca  # Fed-SB at scale 1, round 0 pooled: every run of these grids
read -r -a GRIDS <<< "${GRIDS:-fed-sb-s1-v2 fed-sb-s1-v2-rate-check fed-sb-s1-v2-snli}"
PUBLISHED=evidence/fed-sb-s1  # runs/<grid>/<run>: config, metrics, summary; <grid>-tuning.json
. scripts/fixed_worktree.sh
run_grid_set "$ROOT/fed-sb-s1" "$FED_SB_S1_COMMIT" "$PUBLISHED" "${GRIDS[@]}"
