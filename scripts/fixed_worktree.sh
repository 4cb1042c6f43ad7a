# Sourced by the evidence runners (scripts/evidence_*.sh): the worktree a grid runs in.
#
#   . scripts/fixed_worktree.sh
#   fixed_worktree DIR COMMIT   # DIR: a git worktree at COMMIT (added if missing) with its
#                               # own .venv (scripts/setup.sh, once); exits 2 when DIR is
#                               # checked out at another commit (a grid's runs all run at one)
#   enter_worktree DIR          # cd into DIR, its .venv active, Hub and runtime installs off

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
