#!/usr/bin/env bash
# Fed-SB's published rows rerun at the code where it trains its authors' model (scale s = 1,
# round 0 the pooled gradient; docs/architecture.md): protocol v2 on movie sentiment with
# its own start (lab/grids/fed-sb-s1-v2.yaml: at s = 1 every rate stayed at the majority
# class, the tie rule walking down), a check at larger rates (fed-sb-s1-v2-rate-check.yaml),
# and protocol v2 with the tuning's start scaled to s = 1 on movie sentiment and SNLI
# (fed-sb-s1-v2-lr4x.yaml, fed-sb-s1-v2-lr4x-snli.yaml: each its tuning until interior, then
# its seeds), its cross-silo privacy arm from the same start (fed-sb-s1-privacy-cross-silo.yaml,
# and at epsilon = 3 fed-sb-s1-privacy-cross-silo-eps3.yaml), its cross-device pilot
# (fed-sb-s1-privacy-cross-device-pilot.yaml) and private grid (fed-sb-s1-privacy-cross-device.yaml,
# written from the pilot by florg_lab.cross_device_sizing);
# run at one fixed commit in a worktree of their own, resumable across sittings;
# and
# their publication under lab/evidence/fed-sb-s1/ (the runs at s = 4 stay where they were
# published, lab/evidence/evidence-v2-exact and lab/evidence/privacy-regimes, for comparison).
#
#   bash lab/scripts/evidence_fed_sb.sh [ROOT]                 # prepare ROOT/fed-sb-s1, run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_fed_sb.sh ROOT   # finished runs into lab/evidence/fed-sb-s1
#   GRIDS="fed-sb-s1-v2" bash lab/scripts/evidence_fed_sb.sh ROOT   # a subset of the grids
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
FED_SB_S1_COMMIT=d9539ca  # Fed-SB at scale 1, round 0 pooled: every run of these grids
read -r -a GRIDS <<< "${GRIDS:-fed-sb-s1-v2 fed-sb-s1-v2-rate-check fed-sb-s1-v2-lr4x fed-sb-s1-v2-lr4x-snli fed-sb-s1-privacy-cross-silo fed-sb-s1-privacy-cross-silo-eps3 fed-sb-s1-privacy-cross-device-pilot fed-sb-s1-privacy-cross-device}"
PUBLISHED=lab/evidence/fed-sb-s1  # runs/<grid>/<run>: config, metrics, summary; <grid>-tuning.json
. lab/scripts/fixed_worktree.sh

# The lr4x grid's seed-0 runs at 2e-3 to 3.2e-2 have the settings of runs already published
# by fed-sb-s1-v2 (2e-3) and the rate check (4e-3 to 3.2e-2); runs are deterministic, so the
# runner finds them finished instead of running them again.
reuse_runs() {
  local into="$ROOT/fed-sb-s1/results/fed-sb-s1-v2-lr4x/runs" rate from
  [ -z "${PUBLISH_ONLY:-}" ] || return 0
  mkdir -p "$into"
  for rate in 0.002 0.004 0.008 0.016 0.032; do
    for from in "$PUBLISHED"/runs/fed-sb-s1-v2{,-rate-check}/"learning-rate=$rate,method=fed-sb,seed=0,task=movie-sentiment"; do
      [ ! -d "$from" ] || cp -rn "$from" "$into/"
    done
  done
}
case " ${GRIDS[*]} " in *" fed-sb-s1-v2-lr4x "*) reuse_runs ;; esac
# The grids run after DP-SGD stopped failing a reply whose round's first Poisson draw is
# empty (c8b6fca; the draws and steps are otherwise the same, run for run) go to a worktree
# at that commit; the others stay at FED_SB_S1_COMMIT, where they ran.
FIXED_COMMIT=c8b6fca
AFTER_FIX=" fed-sb-s1-privacy-cross-silo-eps3 fed-sb-s1-privacy-cross-device "
BEFORE=() AFTER=()
for grid in "${GRIDS[@]}"; do
  case "$AFTER_FIX" in *" $grid "*) AFTER+=("$grid") ;; *) BEFORE+=("$grid") ;; esac
done
# (each set in a subshell: run_grid_set enters its worktree and activates its venv)
[ ${#BEFORE[@]} -eq 0 ] || (run_grid_set "$ROOT/fed-sb-s1" "$FED_SB_S1_COMMIT" "$PUBLISHED" "${BEFORE[@]}")
[ ${#AFTER[@]} -eq 0 ] || (run_grid_set "$ROOT/fed-sb-s1-fixed" "$FIXED_COMMIT" "$PUBLISHED" "${AFTER[@]}")
