"""The process supervisor (florg_tools/processes.py): identity by pid + start time, process
trees, tags that survive re-parenting, and stopping everything by pid."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from florg_tools.processes import (
    TAG_ENV_VAR,
    TrackedProcess,
    descendants,
    is_alive,
    process_info,
    process_table,
    spawn,
    still_alive,
    tagged_processes,
    terminate_tree,
)

# A parent that starts a child and a detached grandchild (double fork: it re-parents to
# init, so only its environment tag links it to us), prints their pids, then waits.
TREE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
orphan = subprocess.Popen([sys.executable, "-c",
    "import os, subprocess, sys, time; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(p.pid, flush=True); os._exit(0)"], stdout=subprocess.PIPE, text=True)
grandchild = int(orphan.stdout.readline())
orphan.wait()
print(child.pid, grandchild, flush=True)
time.sleep(120)
"""


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _start_tree(tmp_path: Path) -> tuple[TrackedProcess, int, int]:
    log = tmp_path / "tree.log"
    popen, tag = spawn([sys.executable, "-c", TREE], env=dict(os.environ), log_path=log)
    tracked = TrackedProcess(popen, tag, log)
    tracked.start_tracking(interval=0.1)
    _wait_for(lambda: len(log.read_text().split()) == 2)
    child, grandchild = (int(x) for x in log.read_text().split())
    return tracked, child, grandchild


def test_table_knows_this_process_and_its_start_time():
    me = process_table()[os.getpid()]
    assert me.ppid == os.getppid()
    assert me.pgid == os.getpgrp()
    assert abs(me.start_time - psutil.Process().create_time()) < 0.01
    assert not me.zombie and not me.tagged
    assert is_alive(me)
    # The same pid with another start time is another (a later) process.
    assert not is_alive(dataclasses.replace(me, start_time=me.start_time - 3600.0))
    assert process_info(2**22 + 12345) is None  # above the kernel's pid_max


def test_tracked_tree_finds_descendants_and_tagged_orphans_then_stops_them(tmp_path):
    tracked, child, grandchild = _start_tree(tmp_path)
    try:
        table = process_table(tracked.tag)
        assert child in {p.pid for p in descendants(table, tracked.pid)}
        assert table[grandchild].ppid != tracked.pid  # re-parented away from the tree
        assert grandchild not in {p.pid for p in descendants(table, tracked.pid)}
        tagged = {p.pid for p in tagged_processes(tracked.tag)}
        assert {tracked.pid, child, grandchild} <= tagged
        assert os.getpid() not in tagged
        assert process_info(grandchild, tracked.tag).tagged
        assert not process_info(grandchild, "another-tag").tagged
        _wait_for(lambda: {child, grandchild} <= {p.pid for p in tracked.recorded()})
    finally:
        survivors = tracked.stop(grace=2.0)
    assert survivors == []
    assert still_alive(tracked.recorded(), tracked.tag) == []
    assert tracked.popen.poll() is not None
    assert not any(is_alive(p) for p in tracked.recorded() if p.pid in (child, grandchild))


def test_still_alive_reports_what_outlives_its_parent(tmp_path):
    tracked, child, grandchild = _start_tree(tmp_path)
    try:
        tracked.scan()
        tracked.popen.kill()  # the parent dies; its child and the orphan live on
        tracked.popen.wait()
        alive = {p.pid for p in still_alive(tracked.recorded(), tracked.tag)}
        assert {child, grandchild} <= alive
        assert tracked.pid not in alive
    finally:
        assert tracked.stop(grace=1.0) == []


def test_terminate_tree_ends_a_process_and_its_descendants(tmp_path):
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(c.pid, flush=True); time.sleep(120)"
    )
    popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(popen.stdout.readline())
        info = process_info(child)
        assert info is not None and is_alive(info)
        assert terminate_tree(popen.pid, timeout=10.0) == []
        popen.wait(timeout=10.0)
        assert not is_alive(info)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    assert terminate_tree(popen.pid) == []  # gone: nothing to do


def test_spawn_tags_the_environment_and_logs_the_command(tmp_path):
    log = tmp_path / "logs" / "echo.log"
    env = {**os.environ, TAG_ENV_VAR: "inherited-from-a-parent"}
    code = f"import os; print(os.environ[{TAG_ENV_VAR!r}])"
    popen, tag = spawn([sys.executable, "-c", code], env=env, log_path=log, header=True)
    assert popen.wait(timeout=60) == 0
    first, second = log.read_text().splitlines()
    assert first.startswith("$ ") and first.endswith(code)
    assert second == tag != "inherited-from-a-parent"
