#!/usr/bin/env bash
# Accuracy per byte with the grouped encodings: protocol v2 on movie sentiment and SNLI with
# FLoRG, FedIT and RoLoRA sending fp32, int8-g, int4-g and int4-g with uplink error feedback
# both ways (lab/grids/encodings-groups.yaml, encodings-groups-snli.yaml: each method at its
# published rate, five seeds, fp32 paired at the same commit), run at one fixed commit in a
# worktree of its own, resumable across sittings (published runs are copied back and
# skipped); and their publication under lab/evidence/encodings-groups/.
#
#   bash lab/scripts/evidence_encodings_groups.sh [ROOT]                 # prepare ROOT/encodings-groups, run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_encodings_groups.sh ROOT   # finished runs into lab/evidence/encodings-groups
#   GRIDS="encodings-groups" bash lab/scripts/evidence_encodings_groups.sh ROOT   # one of the grids
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
GROUPS_COMMIT=3c119fc  # int8-g / int4-g packed messages, uplink error feedback, wire byte count
read -r -a GRIDS <<< "${GRIDS:-encodings-groups encodings-groups-snli}"
PUBLISHED=lab/evidence/encodings-groups  # runs/<grid>/<run>: config, metrics, summary
. lab/scripts/fixed_worktree.sh
run_grid_set "$ROOT/encodings-groups" "$GROUPS_COMMIT" "$PUBLISHED" "${GRIDS[@]}"
