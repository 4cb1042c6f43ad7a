#!/usr/bin/env bash
# Secure aggregation's cost in accuracy: FedIT, RoLoRA and FLoRG in the clear and under
# SecAgg+, and FedIT under dp=central both ways (lab/grids/secure-aggregation.yaml: five
# seeds, paired at the same commit), run at one fixed commit in a worktree of its own,
# resumable across sittings (published runs are copied back and skipped); and their
# publication under lab/evidence/secure-aggregation/.
#
#   bash lab/scripts/evidence_secure.sh [ROOT]                 # prepare ROOT/secure-aggregation, run
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_secure.sh ROOT   # finished runs into lab/evidence/secure-aggregation
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
SECURE_COMMIT=5781cc3  # secure-aggregation=secaggplus, dp=central on the masked sum
PUBLISHED=lab/evidence/secure-aggregation  # runs/<grid>/<run>: config, metrics, summary
. lab/scripts/fixed_worktree.sh
run_grid_set "$ROOT/secure-aggregation" "$SECURE_COMMIT" "$PUBLISHED" secure-aggregation
