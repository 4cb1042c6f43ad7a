# Sourced by the evidence runners (scripts/evidence_*.sh): the worktree a grid runs in.
#
#   . lab/scripts/fixed_worktree.sh
#   fixed_worktree DIR COMMIT   # DIR: a git worktree at COMMIT (added if missing) with its
#                               # own .venv (scripts/setup.sh, once); exits 2 when DIR is
#                               # checked out at another commit (a grid's runs all run at one)
#   enter_worktree DIR          # cd into DIR, its .venv active, Hub and runtime installs off
#   copy_grids DIR PUBLISHED GRID...     # grid files and published runs into DIR
#   publish_grids DIR PUBLISHED GRID...  # DIR's finished runs into PUBLISHED
#   run_grid_set DIR COMMIT PUBLISHED GRID...  # all of it, by PUBLISH_ONLY / PREPARE_ONLY
#   hold_grid_lock ROOT         # one runner at a time under ROOT, or exit 3 naming the holder
#   grid_runner                 # the grid runner's module in the current directory's checkout

# hold_grid_lock ROOT: the grids each take the whole machine (one Ray actor per core), so two
# runners side by side on the 2 cores made each run about 3x slower, not 2x (measured
# 2026-11-29: the long grid's round 31 s beside the decoder check against 11 s alone): less
# done than one after the other. The lock (ROOT/.grid-runner.lock, flock) is taken by the
# first runner of a process tree and inherited by the runners it starts (the queue's).
hold_grid_lock() {
  [ -z "${FLORG_GRID_LOCK_HELD:-}" ] || return 0
  local lock="$1/.grid-runner.lock"
  exec 9>>"$lock"
  if ! flock -n 9; then
    echo "hold_grid_lock: another evidence runner holds $lock (pid $(cat "$lock.pid" 2>/dev/null || echo '?')); grids side by side run about 3x slower each: wait for it, or stop it by its pid" >&2
    exit 3
  fi
  echo $$ > "$lock.pid"
  export FLORG_GRID_LOCK_HELD=1
}

# grid_runner: the module of the grid runner in the checkout of the current directory:
# florg_lab (lab/florg_lab, where the lab lives since it moved out of the app) or, in a
# worktree at a commit from before, florg_tools.experiments.
grid_runner() {
  if [ -d lab/florg_lab ]; then echo florg_lab; else echo florg_tools.experiments; fi
}

fixed_worktree() {
  local dir=$1 commit=$2
  if [ ! -d "$dir" ]; then
    git worktree add --detach "$dir" "$commit"
  fi
  [ "$(git -C "$dir" rev-parse HEAD)" = "$(git rev-parse "$commit^{commit}")" ] \
    || { echo "fixed_worktree: $dir is not at $commit" >&2; exit 2; }
  [ -x "$dir/.venv/bin/python" ] || (cd "$dir" && bash scripts/setup.sh)
}

# enter_worktree DIR: run offline from DIR's .venv (cd, activate, the offline switches).
enter_worktree() {
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
  cd "$1"
  . .venv/bin/activate
}

# copy_grids DIR PUBLISHED GRID...: each grid file into the folder the fixed commit's runner
# reads grids from (DIR's lab/grids, or conf/grids at a commit from before the lab moved),
# and the runs already published into DIR's results, so the runner skips them (runs are
# deterministic).
# A grid's runs are published under PUBLISHED/runs/GRID (publish_grids), or, for a grid
# with a report of its own such as the decoder check, under PUBLISHED/GRID/runs.
copy_grids() {
  local dir=$1 published=$2 grid from
  shift 2
  local grids_dir="$dir/conf/grids"
  [ ! -d "$dir/lab/florg_lab" ] || grids_dir="$dir/lab/grids"
  for grid in "$@"; do
    cp "lab/grids/$grid.yaml" "$grids_dir/"
    mkdir -p "$dir/results/$grid/runs"
    for from in "$published/runs/$grid" "$published/$grid/runs"; do
      [ ! -d "$from" ] || cp -rn "$from/." "$dir/results/$grid/runs/"
    done
  done
}

# publish_grids DIR PUBLISHED GRID...: every finished run of each grid in DIR's results
# (config, metrics, summary) into PUBLISHED/runs/GRID, and its tuning.json as
# PUBLISHED/GRID-tuning.json.
publish_grids() {
  local dir=$1 published=$2 grid run out dest
  shift 2
  for grid in "$@"; do
    out="$dir/results/$grid"
    mkdir -p "$published/runs/$grid"
    for run in "$out"/runs/*/; do
      [ -d "$run" ] || continue
      grep -qs '"status": *"finished"' "$run/summary.json" || continue  # unfinished or failed
      dest="$published/runs/$grid/$(basename "$run")"
      mkdir -p "$dest"
      cp "$run"/config.json "$run"/metrics.jsonl "$run"/summary.json "$dest/"
    done
    [ ! -f "$out/tuning.json" ] || cp "$out/tuning.json" "$published/$grid-tuning.json"
  done
  echo "publish_grids: $(find "$published/runs" -name summary.json | wc -l) finished runs in $published"
}

# run_grid_set DIR COMMIT PUBLISHED GRID...: a set of grids run at one commit in the
# worktree DIR. PUBLISH_ONLY=1: publish_grids and stop; PREPARE_ONLY=1: the worktree and
# its grids ready, nothing run; else each grid in turn (the runner resumes and skips
# finished runs).
run_grid_set() {
  local dir=$1 commit=$2 published=$3 grid
  shift 3
  if [ -n "${PUBLISH_ONLY:-}" ]; then
    publish_grids "$dir" "$published" "$@"
    return 0
  fi
  fixed_worktree "$dir" "$commit"
  copy_grids "$dir" "$published" "$@"
  [ -z "${PREPARE_ONLY:-}" ] || return 0
  hold_grid_lock "$(dirname "$dir")"
  enter_worktree "$dir"
  # --all: the optional SmolLM2-135M as well, which the decoder check's runs load (about a
  # minute the first time on a machine, nothing after).
  python -m florg_tools.assets fetch --all
  for grid in "$@"; do
    python -m "$(grid_runner)" run "$grid" --no-report
  done
}
