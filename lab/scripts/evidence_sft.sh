#!/usr/bin/env bash
# The causal-LM evidence on this CPU (issue 28: lab/grids/sft-cpu.yaml, FLoRG against FedIT
# on SmolLM2-135M, squad-gen) at one fixed commit, resumable across sittings.
#
#   bash lab/scripts/evidence_sft.sh [ROOT]               # prepare ROOT/sft, then run
#   PREPARE_ONLY=1 bash lab/scripts/evidence_sft.sh ROOT  # prepare only
# (ROOT defaults to ../florg-evidence.) The grid finished on 2026-11-28: rerunning it
# copies the published runs in and finds nothing left to run.
#
# The worktree ROOT/sft is checked out at SFT_COMMIT (below: fixed since the grid's first
# run; the centralised reference ran at 2afb3fb) with its own .venv; the grid file is
# data, copied from this checkout. Runs already published under lab/evidence/sft-cpu/ are
# copied in first, so the runner skips them. In order:
#   1. the centralised reference (sft-cpu.yaml's header: LoRA, the budget's 128 steps, its
#      rate tuned on validation at seed 0, then seeds 1-2), unless its JSON exists: the
#      budget is one at which LoRA learns when the reference's test gen-F1 clears the
#      untrained model's;
#   2. the grid, one method at a time (its tuning, then its seeds): florg, fedit.
# Publish what has finished from this checkout with:
#   florg experiments evidence sft-cpu --out ROOT/sft/results/sft-cpu \
#       --centralised ROOT/sft/results/sft-cpu/centralised-reference.json \
#       --publish lab/evidence/sft-cpu
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
SFT_COMMIT=2e0dfe2
ROOT="${1:-../florg-evidence}"
PUBLISHED=lab/evidence/sft-cpu
dir="$ROOT/sft"
mkdir -p "$ROOT"
. lab/scripts/fixed_worktree.sh
fixed_worktree "$dir" "$SFT_COMMIT"

cp lab/grids/sft-cpu.yaml "$dir/conf/grids/"
out="$dir/results/sft-cpu"
mkdir -p "$out/runs"
[ ! -d "$PUBLISHED/runs/sft-cpu" ] || cp -rn "$PUBLISHED/runs/sft-cpu/." "$out/runs/"
[ ! -f "$PUBLISHED/centralised-reference.json" ] \
  || cp -n "$PUBLISHED/centralised-reference.json" "$out/"
[ -z "${PREPARE_ONLY:-}" ] || exit 0

enter_worktree "$dir"
python -m florg_tools.assets fetch --only SmolLM2-135M squad
reference="results/sft-cpu/centralised-reference.json"
if [ ! -f "$reference" ]; then
  # sft-cpu.yaml's header command, written to the reference file (resumes per task)
  python -m benchmarks.centralised.centralised_reference --model SmolLM2-135M \
    --task squad-gen --methods fedit --learning-rates 0.00025,0.0005,0.001 --seeds 0,1,2 \
    --steps 128 --eval-every 32 --restart-every 8 --batch-size 4 --rank 4 \
    --max-eval-examples 32 --max-test-examples 200 \
    --set task-kind=causal-lm --set target-modules=q_proj,v_proj --set alpha=16.0 \
    --set max-seq-length=256 --set max-new-tokens=16 --json "$reference.partial"
  mv "$reference.partial" "$reference"
fi
for method in florg fedit; do
  python -m "$(grid_runner)" run sft-cpu --no-report --only "method=$method,"
done
