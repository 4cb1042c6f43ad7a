#!/usr/bin/env bash
# Test machinery (python -m ci.docker_standin all), for a machine that reaches package
# indexes but no container registry (this project's CI machines): build local STAND-INS
# for Flower's official images under the official names
# (flwr/superlink:1.42.0, flwr/supernode:1.42.0, flwr/superexec:1.42.0) and fill
# docker/wheelhouse/ so that docker/Dockerfile builds offline; then
# `bash scripts/docker_demo.sh` runs docker/compose.yml + docker/with-tls.yml unchanged.
# On a machine that can pull, do not run this: compose pulls the official images.
#
#   bash ci/docker_standin.sh               # the engine of DOCKER_HOST (or the default one)
#
# Needs root for debootstrap (Debian 12 minbase from this machine's apt mirror, once),
# a docker client that builds with BuildKit (Debian's docker.io, or one with buildx), and
# Python 3.11 with pip (this repository's .venv): the wheels are fetched by the host's pip,
# the builds get no network. How the stand-ins differ from Flower's images:
# docs/deploy-docker.md. Undo the offline build with
# `python -m florg_tools.deploy.docker_offline clear`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FLORG_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  [ "$VENV" = .venv ] || { echo "docker_standin: no Python env at $VENV" >&2; exit 2; }
  bash scripts/setup.sh
fi
export DOCKER_BUILDKIT=1
exec "$VENV/bin/python" -m ci.docker_standin all
