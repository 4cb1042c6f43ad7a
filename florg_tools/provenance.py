"""Where a run's code came from: the git commit of the app's checkout, recorded in the run's
``config.json`` as ``app-commit`` (the tooling sets it when it launches a run,
``florg_tools.flwr_cli.run_flower_app``), so a published run names the code it ran; the grid
runner records it per run too (``florg_lab.runner``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

MODIFIED = "+modified"


def checkout_commit(app_dir: Path) -> str | None:
    """``<commit>`` of the git checkout holding ``app_dir``, with ``+modified`` when its
    tracked files differ from that commit (a grid file copied into a fixed worktree does);
    None outside a git checkout (or without git)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(app_dir), *args], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return commit + (MODIFIED if changes else "")
