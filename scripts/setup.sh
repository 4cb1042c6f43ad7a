#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with the CPU build of
# PyTorch installed first (so nothing pulls the CUDA wheels), then this project (with
# flwr[simulation,dp] 1.42, pyproject.toml; the dp extra is the privacy accountant) and
# the lab beside it (lab/pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
# setuptools announces every editable install of a flat layout like this one with an
# informational "Editable installation." UserWarning (folders named like a package may
# shadow it), which pip prints as a BuildBackendWarning block. The editable modes do not
# avoid it (strict adds its own, compat a deprecation), so these two installs filter that
# one message, by its start; every other warning and every error still shows.
QUIET_EDITABLE="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation:UserWarning"
PYTHONWARNINGS="$QUIET_EDITABLE" python -m pip install -q -e ".[test,tracking]"
# The lab (lab/README.md: the experiment grids, their tools, the published evidence), a
# package of its own beside the app; the tests cover it too.
PYTHONWARNINGS="$QUIET_EDITABLE" python -m pip install -q -e lab
echo "setup: done ($(python -c 'import torch, flwr; print("torch", torch.__version__, "flwr", flwr.__version__)'))"
