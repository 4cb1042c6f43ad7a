#!/usr/bin/env bash
# The verdict in the paper's regime and the local-training sweep: protocol v2
# with 20 clients, batch 4 and one local epoch a round, six methods tuned until interior,
# five seeds (lab/grids/paper-regime-snli.yaml), then 480 local steps a client split as
# 32 x 15, 10 x 48 or 3 x 160 for FLoRG, FedIT and FedRot-LoRA at their paper-regime
# rates, five seeds (lab/grids/local-steps-sweep.yaml); about 12 h on the 2-core machine
# (the grids' headers size them). Run at one fixed commit in a worktree of its own,
# resumable across sittings (published runs are copied back and skipped); published under
# lab/evidence/paper-regime/ with the evidence report, the curves and the sweep's report.
#
# The sweep's rates: once paper-regime-snli has finished, each method's choice (its
# tuning.json, read by python -m florg_lab.local_steps --rates with this repository's lab)
# is written over the CHOSEN-RATE placeholders of the worktree's copy of the sweep grid.
#
#   bash lab/scripts/evidence_paper_regime.sh [ROOT]                 # prepare ROOT/paper-regime, run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_paper_regime.sh ROOT   # runs and reports into lab/evidence/paper-regime
#   GRIDS="local-steps-sweep" bash lab/scripts/evidence_paper_regime.sh ROOT   # one of the grids
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
REPO=$(pwd)
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
# fedrot-lora and every other method of the grids. The sweep's product_rel_gap (FedIT's
# and FedRot-LoRA's aggregation error) is not recorded at this commit: move it to the
# commit that records it before the first run (a grid's runs all run at one commit).
PAPER_COMMIT=d950897  # the v2 protocol, SNLI's paper regime, product-gap (FedIT's and FedRot-LoRA's product_rel_gap)
read -r -a GRIDS <<< "${GRIDS:-paper-regime-snli local-steps-sweep}"
PUBLISHED=lab/evidence/paper-regime  # runs/<grid>/<run>: config, metrics, summary
DIR="$ROOT/paper-regime"
TUNED=paper-regime-snli  # the grid whose choices the sweep runs at
SWEEP=local-steps-sweep
. lab/scripts/fixed_worktree.sh

# pin_rates: TUNED's chosen rate per method over the CHOSEN-RATE placeholders of DIR's
# copy of SWEEP; fails when a method of SWEEP has no choice yet (TUNED unfinished).
pin_rates() {
  local file="$DIR/lab/grids/$SWEEP.yaml" tuning="$DIR/results/$TUNED/tuning.json"
  local rates="$DIR/results/$SWEEP/rates.txt" method rate
  [ -f "$tuning" ] || tuning="$REPO/$PUBLISHED/$TUNED-tuning.json"
  [ -f "$tuning" ] || { echo "pin_rates: no tuning.json of $TUNED" >&2; exit 2; }
  # from this repository (its lab: the worktree's commit predates florg_lab.local_steps)
  (cd "$REPO" && .venv/bin/python -m florg_lab.local_steps --rates "$tuning") > "$rates"
  for method in $(grep -oE 'CHOSEN-RATE [a-z-]+$' "$file" | cut -d' ' -f2 | sort -u); do
    rate=$(awk -v m="$method" '$1 == m {print $2}' "$rates")
    [ -n "$rate" ] || { echo "pin_rates: $TUNED has no choice for $method yet" >&2; exit 2; }
    sed -i -E "s/^( *learning-rate: )\[[^]]*\](  # CHOSEN-RATE $method)\$/\1[$rate]\2/" "$file"
    echo "pin_rates: $SWEEP: $method at learning-rate $rate"
  done
}

wants() {  # GRID: whether GRIDS names it
  [[ " ${GRIDS[*]} " == *" $1 "* ]]
}

if [ -n "${PUBLISH_ONLY:-}" ]; then
  publish_grids "$DIR" "$PUBLISHED" "${GRIDS[@]}"
  # the reports, by this checkout's code and environment
  [ ! -x .venv/bin/python ] || PATH="$PWD/.venv/bin:$PATH"
  results="$DIR/results"
  if wants "$TUNED" && [ -f "$results/$TUNED/tuning.json" ]; then
    # the evidence report (summary.json: test scores by seed, the pages' paired
    # differences to FLoRG and FedIT) and the per-round curves with 95% t bands
    python -m "$(grid_runner)" evidence "$TUNED" --out "$results/$TUNED" --publish "$PUBLISHED"
    python -m florg_lab.long_budget "$results/$TUNED" --rounds 1 2 3 4 --last 3 \
      --baselines fedit fedrot-lora federa rolora florg-no-procrustes \
      --plot "$PUBLISHED/$TUNED-curve.png" --json "$PUBLISHED/$TUNED-curve.json" \
      | tee "$PUBLISHED/$TUNED-curve.md"
  fi
  if wants "$SWEEP" && [ -d "$PUBLISHED/runs/$SWEEP" ]; then
    # the sweep's grid as run (the pinned rates), its report and figure
    [ ! -f "$DIR/lab/grids/$SWEEP.yaml" ] || cp "$DIR/lab/grids/$SWEEP.yaml" "$PUBLISHED/"
    python -m florg_lab.local_steps "$PUBLISHED/runs/$SWEEP" \
      --plot "$PUBLISHED/$SWEEP.png" --json "$PUBLISHED/$SWEEP.json" \
      | tee "$PUBLISHED/$SWEEP-report.md"
  fi
  exit 0
fi
fixed_worktree "$DIR" "$PAPER_COMMIT"
copy_grids "$DIR" "$PUBLISHED" "${GRIDS[@]}"
[ -z "${PREPARE_ONLY:-}" ] || exit 0
hold_grid_lock "$ROOT"
# the lock's descriptor is inherited by the subshells (they leave this shell in the repo)
for grid in "${GRIDS[@]}"; do
  [ "$grid" != "$SWEEP" ] || pin_rates
  (
    enter_worktree "$DIR"
    python -m florg_tools.assets fetch
    python -m "$(grid_runner)" run "$grid" --no-report
  )
done
