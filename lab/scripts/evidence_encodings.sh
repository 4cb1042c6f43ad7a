#!/usr/bin/env bash
# Accuracy per byte: protocol v2 on movie sentiment and SNLI with FLoRG, FedIT and RoLoRA
# sending bf16 and int8 messages both ways (lab/grids/encodings-v2.yaml,
# encodings-v2-snli.yaml: each method at its published rate, five seeds, paired with the
# published fp32 runs; one fp32 run a method at seed 0 checks the commit reproduces them),
# run at one fixed commit in a worktree of its own, resumable across sittings; and their
# publication under lab/evidence/encodings/.
#
#   bash lab/scripts/evidence_encodings.sh [ROOT]                 # prepare ROOT/encodings, run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_encodings.sh ROOT   # finished runs into lab/evidence/encodings
#   GRIDS="encodings-v2" bash lab/scripts/evidence_encodings.sh ROOT   # one of the grids
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
ENCODINGS_COMMIT=1163791  # uplink-encoding / downlink-encoding, the bytes of each message's content
read -r -a GRIDS <<< "${GRIDS:-encodings-v2 encodings-v2-snli}"
PUBLISHED=lab/evidence/encodings  # runs/<grid>/<run>: config, metrics, summary
. lab/scripts/fixed_worktree.sh
run_grid_set "$ROOT/encodings" "$ENCODINGS_COMMIT" "$PUBLISHED" "${GRIDS[@]}"
