# Sourced by lab/scripts/evidence_v2.sh (which runs protocol v2's grids) and
# lab/scripts/publish_evidence_v2.sh (which publishes them): where each task's grids run.
# Needs ROOT set (the folder holding the worktrees).
#
#   grids_of TASK      # its main grid and its variants grid
#   worktree_of TASK   # the worktree its grids run in, and that worktree's fixed commit

V2_TASKS="movie-sentiment snli"
V2_COMMIT=34820fb
V2_SNLI_COMMIT=2e0dfe2
V2_PUBLISHED=lab/evidence/evidence-v2

grids_of() {
  case "$1" in
    movie-sentiment) echo "evidence-v2 evidence-v2-variants" ;;
    snli) echo "evidence-v2-snli evidence-v2-snli-variants" ;;
    *) echo "evidence_v2: unknown task $1" >&2; exit 2 ;;
  esac
}

worktree_of() {
  case "$1" in
    movie-sentiment) echo "$ROOT/v2 $V2_COMMIT" ;;
    snli) echo "$ROOT/v2-snli $V2_SNLI_COMMIT" ;;
  esac
}
