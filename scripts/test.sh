#!/usr/bin/env bash
# The project's test command (README: "Set up and test").
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ruff check .
python -m pytest -q
