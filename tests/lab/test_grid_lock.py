"""lab/scripts/fixed_worktree.sh's ``hold_grid_lock``: one evidence runner at a time under a
root (two side by side on the 2 cores each ran about 3x slower); the runners a queue starts
inherit its lock; a second runner exits 3 naming the holder's pid."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bash(script: str, root: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", f". lab/scripts/fixed_worktree.sh; {script}", "lock-test", str(root)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def test_a_second_runner_is_refused_while_the_first_holds_the_lock(tmp_path):
    holder = bash('hold_grid_lock "$1"; echo held; sleep 30', tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = bash('hold_grid_lock "$1"; echo ran', tmp_path)
        out, err = second.communicate(timeout=20)
        assert second.returncode == 3 and "ran" not in out
        assert f"pid {holder.pid}" in err and "3x slower" in err
        # a runner the holder started (the queue's) inherits the lock
        child = bash('hold_grid_lock "$1"; echo ran', tmp_path, FLORG_GRID_LOCK_HELD="1")
        out, _ = child.communicate(timeout=20)
        assert child.returncode == 0 and out.strip() == "ran"
    finally:
        holder.kill()
        holder.wait()
    # the holder gone, the next runner takes the lock
    deadline = time.monotonic() + 10
    while True:
        after = bash('hold_grid_lock "$1"; echo ran', tmp_path)
        out, _ = after.communicate(timeout=20)
        if after.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after.returncode == 0 and out.strip() == "ran"
