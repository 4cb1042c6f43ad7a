#!/usr/bin/env bash
# README command 2 (after scripts/setup.sh): lint, fetch the offline assets, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ruff check .
python -m flower_app.assets fetch
python -m pytest -q "$@"
