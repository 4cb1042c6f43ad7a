#!/usr/bin/env bash
# The docker compose demo in one command (docs/deploy-docker.md): build the app image,
# bring up SuperLink + ServerApp SuperExec + 3 SuperNodes with their ClientApp SuperExecs
# over TLS (a one-shot service generates the certificates into docker/certificates/),
# run FLoRG on it through the `flwr` CLI (the launcher exits non-zero unless the run ends
# finished:completed), copy the run's outputs to outputs/docker/, and take it all down.
#
#   bash scripts/docker_demo.sh                         # FLoRG, the pyproject defaults
#   bash scripts/docker_demo.sh --set method=fedit      # launcher options pass through
#   KEEP_UP=1 bash scripts/docker_demo.sh               # leave the containers running
#   OUTPUTS_DIR=/tmp/out bash scripts/docker_demo.sh    # where the outputs are copied
#   FLORG_VENV=/path/venv bash scripts/docker_demo.sh   # another Python env with flwr
#
# Needs Docker with the compose plugin (or docker-compose), and this repository's .venv
# on the host for the `flwr` CLI (created by scripts/setup.sh when missing).
# On an ordinary machine compose pulls Flower's official images. On a machine that
# reaches package indexes but no image registry, run `bash ci/docker_standin.sh`
# first: stand-ins with the official names, and docker/wheelhouse/ for an offline build
# (docs/deploy-docker.md); tests/deployment/test_docker_engine.py runs this script that way.
set -euo pipefail
cd "$(dirname "$0")/.."

if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose)
  # docker/Dockerfile.dockerignore (keeps .venv and outputs out of the build context)
  # is read by BuildKit only.
  export DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1
else
  echo "docker_demo: needs 'docker compose' or 'docker-compose'" >&2
  exit 2
fi
FILES=(-f docker/compose.yml -f docker/with-tls.yml)
CA=docker/certificates/superlink/ca.crt
CONNECTION=docker-tls

VENV="${FLORG_VENV:-.venv}"
OUTPUTS_DIR="${OUTPUTS_DIR:-outputs/docker}"
if [ ! -x "$VENV/bin/python" ]; then
  [ "$VENV" = .venv ] || { echo "docker_demo: no Python env at $VENV" >&2; exit 2; }
  bash scripts/setup.sh
fi
. "$VENV/bin/activate"
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr_home}"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0

# The committed compose files must be what commands.py generates.
python -m florg_tools.deploy.compose_gen --check docker

cleanup() {
  local cid
  cid=$("${COMPOSE[@]}" "${FILES[@]}" ps -q superexec-serverapp 2>/dev/null || true)
  if [ -n "$cid" ]; then
    mkdir -p "$OUTPUTS_DIR"
    docker cp "$cid:/app/outputs/." "$OUTPUTS_DIR/" >/dev/null 2>&1 \
      && echo "docker_demo: run outputs copied to $OUTPUTS_DIR/"
  fi
  if [ "${KEEP_UP:-0}" != 1 ]; then
    "${COMPOSE[@]}" "${FILES[@]}" down --remove-orphans
  fi
}
trap cleanup EXIT

# certs runs to completion before anything that depends on it is started.
"${COMPOSE[@]}" "${FILES[@]}" up -d --build

# Wait for the SuperLink's HTTPS /health, verified with the demo CA (SAN 127.0.0.1).
python - "$CA" <<'PY'
import ssl, sys, time, urllib.request
ctx = ssl.create_default_context(cafile=sys.argv[1])
deadline, error = time.monotonic() + 180, None
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen("https://127.0.0.1:8000/health", timeout=3, context=ctx) as r:
            if 200 <= r.status < 300:
                print("docker_demo: SuperLink is up (TLS verified)")
                sys.exit(0)
    except OSError as err:
        error = err
    time.sleep(1)
sys.exit(f"docker_demo: SuperLink not healthy after 180 s: {error}")
PY

python -m florg_tools.deploy.compose_gen connection --flwr-home "$FLWR_HOME" \
  --name "$CONNECTION" --address 127.0.0.1:8000 --root-certificates "$CA"
# `flwr run . docker-tls`, then poll `flwr ls` until the run's final status.
python -m florg_tools.launch --connection "$CONNECTION" --flwr-home "$FLWR_HOME" "$@"
