#!/usr/bin/env bash
# Privacy-utility in the two deployed regimes (docs/privacy.md), run at one fixed commit in
# a worktree of their own, resumable across sittings; and their publication.
#
#   bash lab/scripts/evidence_privacy.sh [ROOT]   # prepare ROOT/privacy-regimes, run
#   PREPARE_ONLY=1 ... / PUBLISH_ONLY=1 bash lab/scripts/evidence_privacy.sh ROOT
#
# The grids, in order: cross-silo (example-level DP-SGD on 6 clients,
# lab/grids/privacy-cross-silo.yaml: each method's tuning at epsilon = 8, then its seeds);
# its three checks outside the protocol (privacy-cross-silo-rate-check: FedIT and Fed-SB at
# their rates without DP; privacy-cross-silo-noise-check: the DP-SGD path with negligible
# noise; privacy-cross-silo-batch-check: a batch of 64); the same grid at
# epsilon = 3 (privacy-cross-silo-eps3, written from the tuning's choices); then the
# cross-device pilot (1,000 SuperNodes, lab/grids/privacy-cross-device-pilot.yaml) that
# sizes the cross-device grid; and that grid (privacy-cross-device, written from the
# pilot's published runs by `python -m florg_lab.cross_device_sizing
# lab/evidence/privacy-regimes/runs/privacy-cross-device-pilot --write-grid
# lab/grids/privacy-cross-device.yaml`), FedIT and FLoRG; then Fed-SB's arms of it
# (privacy-cross-device-fed-sb, written by the same command with --methods fed-sb), run at
# FED_SB_COMMIT in a worktree of their own: from that commit on, Fed-SB's round 0 queries the
# round's Poisson sample, as the accountant's q assumes (at PRIVACY_COMMIT it queried a
# fixed-size sample; lab/evidence/privacy-regimes/NOTES.md). GRIDS overrides the list.
# lab/scripts/evidence_queue.sh runs the exact methods' grids before these: they share the 2
# cores.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
PRIVACY_COMMIT=834689a  # the runtime every run of these grids runs at (DP-SGD reports its mechanism; FLoRG's rank-first per-example gradient)
FED_SB_COMMIT=66e1377  # Fed-SB's cross-device grid: its round 0 Poisson-sampled, its z sized for T + 1 releases
FED_SB_GRIDS=" privacy-cross-device-fed-sb "  # the grids run at FED_SB_COMMIT
read -r -a GRIDS <<< "${GRIDS:-privacy-cross-silo privacy-cross-silo-rate-check privacy-cross-silo-noise-check privacy-cross-silo-batch-check privacy-cross-silo-eps3 privacy-cross-device-pilot privacy-cross-device privacy-cross-device-fed-sb}"
PUBLISHED=lab/evidence/privacy-regimes  # runs/<grid>/<run>: config, metrics, summary; tuning
. lab/scripts/fixed_worktree.sh
AT_PRIVACY=() AT_FED_SB=()
for grid in "${GRIDS[@]}"; do
  if [[ $FED_SB_GRIDS == *" $grid "* ]]; then AT_FED_SB+=("$grid"); else AT_PRIVACY+=("$grid"); fi
done
# each set in a subshell: run_grid_set enters its worktree (cd, its .venv)
[ ${#AT_PRIVACY[@]} -eq 0 ] \
  || (run_grid_set "$ROOT/privacy-regimes" "$PRIVACY_COMMIT" "$PUBLISHED" "${AT_PRIVACY[@]}")
[ ${#AT_FED_SB[@]} -eq 0 ] \
  || (run_grid_set "$ROOT/privacy-regimes-fed-sb" "$FED_SB_COMMIT" "$PUBLISHED" "${AT_FED_SB[@]}")
