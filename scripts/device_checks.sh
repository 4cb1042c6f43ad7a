#!/usr/bin/env bash
# Issue 28's GPU checks, run on a lent CUDA machine (its own Python 3.12 with torch,
# transformers and peft; no network; at most 64 MiB sent a call). Pack first on this machine
# (bash scripts/device_pack.sh), then one call per .device-carry/cN folder, each carrying it:
#
#   call 1:  bash scripts/device_checks.sh first          # carry .device-carry/c1
#            (installs the small wheels, checks the imports, then the two benchmarks that
#            need nothing else: the FLoRG server step at the RoBERTa-large and 7B shapes on
#            CUDA with a torch.profiler breakdown of the 7B one, and the decoder benchmark's
#            Llama-3.2-1B-shaped bf16 arm and its SmolLM2-shaped arms, random weights, which
#            need no asset)
#   call k:  bash scripts/device_checks.sh stash ck       # carry .device-carry/ck
#   last:    bash scripts/device_checks.sh last cN        # carry .device-carry/cN
#            (joins the parts, installs Ray, builds SmolLM2-135M with `florg assets fetch`,
#            the decoder benchmark's SmolLM2 arms, then the sft-cpu preset through the Flower
#            simulation in bf16 on CUDA: florg launch --preset sft-cpu --set precision=bf16)
#
#   call:    bash scripts/device_checks.sh methods         # after `first` (its wheels: Opacus)
#            (every registered method's server round at the 7B shape on CUDA, side by side
#            with FLoRG's, and the example-level DP-SGD step FLoRG / LoRA at the
#            RoBERTa-large shape: docs/benchmarks.md, "Every method's server step" and
#            "DP-SGD step time"; about 6-8 minutes, so give it timeout 560)
#
#   or, one call, nothing to install (the decoder benchmark and the server step need only the
#   image's torch, transformers and peft):
#            mkdir -p .device-carry/before && git archive REV | tar -x -C .device-carry/before \
#                && echo REV > .device-carry/before/REVISION      # the code to compare against
#            bash scripts/device_checks.sh side-by-side .device-carry/before ARMS
#            # carry .device-carry/before: the server step at this tree's code, then the
#            # decoder benchmark's ARMS at REV and at this tree's code on the same machine
#
# The parts wait in $DEVICE_STASH (/tmp/florg-device) between calls, which holds while the
# machine stays warm. Every step's output goes to $OUT (what the tool sends back).
set -uo pipefail
cd "$(dirname "$0")/.."
STASH=${DEVICE_STASH:-/tmp/florg-device}
OUT=${OUT:-$PWD/outputs/device}
SITE=$STASH/site
PY=${PYTHON:-python3}
mkdir -p "$STASH/parts" "$OUT"
# Two install folders: pip --target --upgrade replaces a top-level folder it brings again,
# and Ray's wheel brings its own bin/ (which, sharing one folder, dropped Flower's scripts).
RAY_SITE=$STASH/site-ray
export PYTHONPATH="$SITE:$RAY_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$RAY_SITE/bin:$PATH"
export PYTHONUNBUFFERED=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLORG_CACHE=$STASH/cache

stash() {  # copy one carried folder's parts into the stash
    cp -r ".device-carry/$1/." "$STASH/parts/" || { echo "nothing carried in .device-carry/$1"; exit 1; }
    echo "stash now holds:"; ls -la "$STASH/parts" "$STASH/parts/wheels" 2>/dev/null | head -60
}

install_wheels() {  # $1: folder, then wheel files, installed without their dependencies
    local target=$1; shift
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" "$@"
}

setup() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    "$PY" -c 'import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__)' \
        | tee -a "$OUT/gpu.txt"
    install_wheels "$SITE" "$STASH"/parts/wheels/*.whl || exit 1
    "$PY" - <<'EOF' 2>&1 | tee "$OUT/setup.log"
import importlib
for name in ("flwr", "datasets", "flwr_datasets", "omegaconf", "gguf", "dp_accounting",
             "flwr.simulation", "flwr.server", "flwr.supernode", "flwr.cli.app",
             "flower_app.client.round", "flower_app.cache.per_process", "client_app.client_app",
             "server_app.server_app", "florg_tools.launch", "florg_lab",
             "opacus", "benchmarks.core.server_methods", "benchmarks.core.dp_sgd_step"):
    try:
        importlib.import_module(name)
        print("import ok:", name)
    except Exception as err:  # noqa: BLE001 -- a report, one line per module
        print("IMPORT FAILED:", name, type(err).__name__, err)
EOF
}

server_step() {  # FLoRG's batched torch server step on CUDA against the numpy float64 loop
    "$PY" - <<'EOF' 2>&1 | tee "$OUT/server_step.json"
import json
from benchmarks.core.server import gpu_worker
from benchmarks.core.settings import Settings
print(json.dumps(gpu_worker(Settings())))
EOF
}

server_profile() {  # where the 7B-shape step's time goes (torch.profiler, device time)
    "$PY" -m benchmarks.core.server_profile --shape 7b --device cuda --blocks 2>&1 \
        | grep -v '^USDT' | tee "$OUT/server_profile.txt"
}

methods() {  # every method's server round (7B shape) and the DP-SGD step (RoBERTa-large)
    "$PY" -m benchmarks.core.server_methods --shape 7b --device cuda --repeats 3 \
        --json "$OUT/server-methods-7b-cuda.json" 2>&1 | tee "$OUT/server-methods-7b-cuda.txt"
    "$PY" -m benchmarks.core.dp_sgd_step --shape roberta-large --device cuda --steps 60 \
        --threads 8 --json "$OUT/dp-sgd-step-roberta-large-cuda.json" 2>&1 \
        | tee "$OUT/dp-sgd-step-roberta-large-cuda.txt"
}

decoder() {  # $1: arms (on an H100 one pair's ratio spreads widely: 60 pairs, ~80 s an arm)
    "$PY" -m benchmarks.core.decoder_benchmark --device "${DECODER_DEVICE:-cuda}" --threads 8 --arms "$1" \
        --steps "${DECODER_STEPS:-60}" 2>&1 | tee "$OUT/decoder-${2:-${1%%,*}}.log"
}

side_by_side() {  # $1: a checkout of the code to compare against, $2: arms; one machine
    local before=$1 arms=$2
    [ -f "$before/benchmarks/core/decoder_benchmark.py" ] || { echo "no checkout at $before"; exit 1; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    echo "before: $(cat "$before/REVISION" 2>/dev/null || echo '?') (from $before); after: this tree" \
        | tee -a "$OUT/gpu.txt"
    server_step
    (cd "$before" && export PYTHONPATH=$PWD \
        && "$PY" -c 'import flower_app; print("before: code from", flower_app.__file__)' \
        && decoder "$arms" before)
    decoder "$arms" after
}

assets() {
    local n big=$STASH/big
    n=$(cat "$STASH"/parts/big.tar.sha256) || exit 1
    cat "$STASH"/parts/big.part* > "$STASH/big.tar"
    echo "$n  $STASH/big.tar" | sha256sum -c - || exit 1
    rm -rf "$big" && tar -C "$STASH" -xf "$STASH/big.tar" && rm -f "$STASH/big.tar"
    (cd "$big" && sha256sum -c SHA256SUMS) || exit 1
    install_wheels "$RAY_SITE" "$big"/ray-*.whl || exit 1
    "$PY" -c 'import ray; print("ray", ray.__version__)'
    [ -x "$SITE/bin/flower-superlink" ] || { echo "flower-superlink missing from $SITE/bin"; exit 1; }
    mkdir -p "$FLORG_CACHE/data" && tar -C "$FLORG_CACHE/data" -xJf "$big/squad-asset.tar.xz"
    PIP_NO_INDEX=1 PIP_FIND_LINKS=$big "$PY" -m florg_tools.assets fetch --only squad SmolLM2-135M
}

sft() {  # the sft-cpu preset through the Flower simulation, bf16 on CUDA
    local runs=$STASH/runs
    "$PY" -m florg_tools.flwr_home setup --flwr-home "$STASH/flwr_home" --num-supernodes 5
    export FLWR_HOME=$STASH/flwr_home FLORG_OUTPUT_ROOT=$STASH
    local t0=$SECONDS
    "$PY" -m florg_tools.launch --connection local-simulation --ephemeral-superlink \
        --preset sft-cpu --set precision=bf16 --set device=cuda --set output-dir=runs \
        --timeout "${SFT_TIMEOUT:-360}" "$@"
    echo "launch exit $? after $((SECONDS - t0)) s"
    find "$runs" -name checkpoint -prune -o -type f \( -name '*.json' -o -name '*.jsonl' \) -print \
        | tar -czf "$OUT/sft-runs.tar.gz" -T - 2>/dev/null
    find "$runs" -name metrics.jsonl -exec tail -n 3 {} \;
}

case "${1:-}" in
    stash) stash "$2" ;;
    first)
        stash c1 >/dev/null && setup && server_step && server_profile \
            && decoder llama1b-bf16,smollm2shape-bf16,smollm2shape-fp32 ;;
    last)
        stash "$2" >/dev/null
        assets 2>&1 | tee "$OUT/assets.log"
        [ "${PIPESTATUS[0]}" = 0 ] || { echo "assets failed"; exit 1; }
        sft 2>&1 | tee "$OUT/sft.log"
        decoder smollm2-fp32,smollm2-bf16 ;;
    setup | server_step | server_profile | assets | methods) "$1" ;;
    decoder) decoder "$2" ;;
    side-by-side) side_by_side "$2" "$3" ;;
    sft) shift; sft "$@" ;;
    *) echo "usage: $0 first | stash cK | last cN | setup | server_step | server_profile | methods | decoder ARMS | side-by-side DIR ARMS | assets | sft [--set k=v ...]" >&2
       exit 2 ;;
esac
