#!/usr/bin/env bash
# Every evidence grid still due, one after another on this machine's 2 cores, each set at
# its own fixed commit in its own worktree (the runners below say which). Resumable: a run
# already finished (in a worktree, or published under lab/evidence/) is skipped, so a sitting
# restarts this one command and the queue goes on where it stopped.
#
#   bash lab/scripts/evidence_queue.sh [ROOT]                 # default ROOT: ../florg-evidence
#   PUBLISH_ONLY=1 bash lab/scripts/evidence_queue.sh [ROOT]  # every finished run into lab/evidence/
#
# Order (what each answers):
#   1. lab/scripts/evidence_exact.sh     the exact-aggregation methods: decoder check, protocol v2
#   2. lab/scripts/evidence_privacy.sh   privacy-utility: cross-silo DP-SGD, the cross-device pilot
# Each runner prepares its worktree (and .venv) on first use; see its header. A grid that has
# finished and been published leaves the queue (on a fresh machine its runner would build a
# worktree and a .venv, minutes, only to skip every run): lab/scripts/evidence_long.sh, the
# verdict at a long budget, finished on 2026-11-30 and reruns on its own.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
ROOT="${1:-../florg-evidence}"
if [ -z "${PUBLISH_ONLY:-}" ]; then
  mkdir -p "$ROOT"
  . lab/scripts/fixed_worktree.sh
  hold_grid_lock "$(cd "$ROOT" && pwd)"  # one queue or runner at a time: the runners inherit it
fi
failed=()
for runner in evidence_exact evidence_privacy; do
  echo "[evidence_queue] $(date -u +%FT%TZ) $runner"
  # A runner that fails (a run that failed, a worktree at the wrong commit) is reported and
  # the queue goes on: the grids do not depend on one another.
  bash "scripts/$runner.sh" "$ROOT" || failed+=("$runner (exit $?)")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[evidence_queue] $(date -u +%FT%TZ) failed: ${failed[*]}; their logs are above" >&2
  exit 1
fi
echo "[evidence_queue] $(date -u +%FT%TZ) every queued grid is done"
