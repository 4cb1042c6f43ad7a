"""Nothing outlives the process that started it: what ``florg_tools.processes.spawn``
starts dies with its starter even when the starter is killed from outside -- SIGTERM, or
SIGKILL, which no handler sees -- through the parent-death signal and the watchdog
(florg_tools/processes.py's docstring).

The unit tests use plain Python process trees (a child, and a double-forked grandchild that
re-parents away from the tree, as Ray's services and the SuperExec's children do); the
integration tests kill a real ``florg launch --ephemeral-superlink``, a pytest session
holding ``local_simulation_superlink``, and a process holding each of the other servers
the tests start: the private ``dockerd`` with its ``containerd`` (ci/docker_engine/) and
the private Ray cluster (tests/harness/ray_harness.py). Survivors are looked for among the
processes recorded before the kill (pid and start time) and those carrying the server's
environment tag, never by name. Every wait polls with a deadline.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from florg_tools import processes
from florg_tools.processes import (
    ProcInfo,
    TrackedProcess,
    descendants,
    is_alive,
    process_info,
    process_table,
    spawn,
    still_alive,
    tagged_processes,
)
from tests.deployment.test_processes import TREE

REPO = Path(__file__).resolve().parents[2]
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
KILLS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGKILL, id="SIGKILL")]

# TREE (tests/deployment/test_processes.py): a child and a double-forked grandchild re-parented to
# init (only its environment tag links it to us); prints the two pids, then waits.

# A starter: spawns ``python -c argv[2] argv[3:]`` (TREE; log: argv[1]), prints the tag,
# then waits to be killed.
STARTER = """
import os, sys, time
from pathlib import Path
from florg_tools.processes import spawn
popen, tag = spawn([sys.executable, "-c", *sys.argv[2:]], env=dict(os.environ),
                   log_path=Path(sys.argv[1]))
print(tag, flush=True)
time.sleep(120)
"""

# Run as ``python -c UNTAGGED_TREE top UNTAGGED_TREE``: two processes re-parented to init
# that show no tag (as Ray's agents and workers show none once they set their process
# title): a stray in the spawned process's group, and the child of a holder that carries
# the tag, each in a session of its own (as a container under its containerd shim).
# Prints the pids of the holder, its child and the stray, then waits.
UNTAGGED_TREE = """
import os, subprocess, sys, time
role, code = sys.argv[1], sys.argv[2]
untagged = {"PATH": os.environ.get("PATH", "")}

def start(next_role, **kwargs):
    return subprocess.Popen([sys.executable, "-c", code, next_role, code], **kwargs)

if role == "top":
    middle = start("middle", stdout=subprocess.PIPE, text=True)
    pids = middle.stdout.readline().strip()
    middle.wait()
    print(pids, flush=True)
elif role == "middle":  # starts both and exits: they re-parent to init
    holder = start("holder", stdout=subprocess.PIPE, text=True, start_new_session=True)
    stray = start("stray", env=untagged, stdout=subprocess.DEVNULL)
    print(holder.pid, holder.stdout.readline().strip(), stray.pid, flush=True)
    os._exit(0)
elif role == "holder":
    child = start("child", env=untagged, stdout=subprocess.DEVNULL, start_new_session=True)
    print(child.pid, flush=True)
time.sleep(120)
"""


def _wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.1)


def _read_line(popen: subprocess.Popen[str], timeout: float, pattern: str = r"(\S+)") -> str:
    """The first group of ``pattern`` in the first stdout line that matches it."""
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([popen.stdout], [], [], 0.2)
        if not ready:
            continue
        line = popen.stdout.readline()
        if not line:
            break  # it exited
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match.group(1)
    raise AssertionError(f"no line matching {pattern!r} (rc {popen.poll()}):\n{''.join(seen)}")


def _tree_of(pid: int, tag: str) -> list[ProcInfo]:
    """``pid``, its descendants (its watchdogs among them) and what carries ``tag``."""
    table = process_table(tag)
    found = {info.pid: info for info in [*descendants(table, pid), *tagged_processes(tag, table)]}
    if pid in table:
        found[pid] = table[pid]
    return list(found.values())


def _assert_nothing_survives(recorded: list[ProcInfo], tag: str, timeout: float) -> None:
    _wait_for(lambda: not still_alive(recorded, tag), timeout, "the started processes to end")


def _stop(popen: subprocess.Popen[str], recorded: list[ProcInfo], tag: str | None) -> None:
    """Clean up after a failed test: everything it left, by pid and start time."""
    if popen.poll() is None:
        popen.kill()
    popen.wait(timeout=30)
    leftover = still_alive(recorded, tag)
    for info in leftover:
        if is_alive(info):
            os.kill(info.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- unit tests


@pytest.mark.parametrize("sig", KILLS)
def test_a_killed_starter_takes_its_tree_and_the_reparented_grandchild_along(tmp_path, sig):
    log = tmp_path / "tree.log"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(log), TREE],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    recorded: list[ProcInfo] = []
    tag = None
    try:
        tag = _read_line(starter, 30.0)
        _wait_for(lambda: log.exists() and len(log.read_text().split()) == 2, 30.0, "TREE")
        child, grandchild = (int(x) for x in log.read_text().split())
        recorded = _tree_of(starter.pid, tag)
        pids = {info.pid for info in recorded}
        assert {child, grandchild} <= pids
        watchdogs = [p for p in recorded if "_watchdog_main" in p.cmdline]
        assert len(watchdogs) == 1 and watchdogs[0].ppid == starter.pid
        assert process_table()[grandchild].ppid != starter.pid  # re-parented away

        os.kill(starter.pid, sig)
        assert starter.wait(timeout=10) == -sig
        _assert_nothing_survives(recorded, tag, timeout=10.0)
        assert "[watchdog" in log.read_text()  # it says what it had to stop
    finally:
        _stop(starter, recorded, tag)


def test_a_killed_starter_takes_its_reparented_untagged_processes_along(tmp_path):
    # Neither is in the starter's tree nor shows the tag: the watchdog finds the stray as a
    # member of the spawned process's group, the child as a child of a tagged process.
    log = tmp_path / "tree.log"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(log), UNTAGGED_TREE, "top", UNTAGGED_TREE],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    recorded: list[ProcInfo] = []
    tag = None
    try:
        tag = _read_line(starter, 30.0)
        _wait_for(lambda: log.exists() and len(log.read_text().split()) == 3, 30.0, "the tree")
        holder, child, stray = (int(x) for x in log.read_text().split())
        recorded = _tree_of(starter.pid, tag)
        table = process_table(tag)
        assert table[holder].tagged and table[holder].pgid == holder  # a session of its own
        spawned = next(p for p in recorded if p.ppid == starter.pid and p.tagged)
        assert table[stray].pgid == spawned.pid  # the spawned process's group
        for pid in (child, stray):
            assert not table[pid].tagged and pid not in {p.pid for p in recorded}
            recorded.append(table[pid])

        os.kill(starter.pid, signal.SIGKILL)
        assert starter.wait(timeout=10) == -signal.SIGKILL
        _assert_nothing_survives(recorded, tag, timeout=10.0)
    finally:
        _stop(starter, recorded, tag)


def test_the_watchdog_sweeps_on_sigterm_and_leaves_when_released(tmp_path):
    log = tmp_path / "tree.log"
    popen, tag = spawn([sys.executable, "-c", TREE], env=dict(os.environ), log_path=log)
    tracked = TrackedProcess(popen, tag, log)
    try:
        watchdog = processes._watchdogs[tag]
        _wait_for(lambda: len(log.read_text().split()) == 2, 30.0, "TREE")
        tracked.scan()
        # An outer tracker stopping our tree signals the watchdog too: it sweeps our tag.
        os.kill(watchdog.pid, signal.SIGTERM)
        assert watchdog.wait(timeout=10) == 0
        _assert_nothing_survives(tracked.recorded(), tag, timeout=10.0)
        popen.wait(timeout=10)
    finally:
        assert tracked.stop(grace=1.0) == []
    assert tag not in processes._watchdogs  # released and reaped


def test_a_watchdog_ends_by_itself_once_its_process_has_exited(tmp_path):
    log = tmp_path / "l"
    popen, tag = spawn([sys.executable, "-c", "pass"], env=dict(os.environ), log_path=log)
    watchdog = processes._watchdogs[tag]
    assert popen.wait(timeout=30) == 0
    assert watchdog.wait(timeout=15) == 0  # nothing left to guard (scans each second)
    assert log.read_text() == ""  # quietly
    processes._reap_watchdogs()
    assert tag not in processes._watchdogs


def test_a_process_spawned_from_a_worker_thread_outlives_that_thread(tmp_path):
    # The parent-death signal fires when the *thread* that forked dies: off the main thread
    # spawn leaves it out (the watchdog still guards the process against this one's death).
    started: list[tuple[subprocess.Popen[bytes], str]] = []
    code = "import time; time.sleep(120)"
    worker = threading.Thread(
        target=lambda: started.append(
            spawn([sys.executable, "-c", code], env=dict(os.environ), log_path=tmp_path / "l")
        )
    )
    worker.start()
    worker.join()
    popen, tag = started[0]
    tracked = TrackedProcess(popen, tag, tmp_path / "l")
    try:
        info = process_info(popen.pid)
        assert info is not None
        time.sleep(0.5)  # a parent-death SIGKILL would have landed by now
        assert popen.poll() is None and is_alive(info)
    finally:
        assert tracked.stop(grace=1.0) == []


def test_signals_interrupt_cleans_up_then_dies_by_the_signal():
    # SIGTERM is handled like Ctrl-C; a second one (GNU timeout signals the process and
    # then its group) does not cut the cleanup short; then the process ends by SIGTERM.
    code = """
import sys, time
from florg_tools.processes import die_by_signal, signals_interrupt
with signals_interrupt() as received:
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        print("cleaning", flush=True)
        time.sleep(1.0)
        print("cleaned up", flush=True)
print("signal", received.signum, flush=True)
sys.exit(die_by_signal(received.signum))
"""
    command = [sys.executable, "-c", code]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert _read_line(proc, 30.0) == "ready"
        proc.send_signal(signal.SIGTERM)
        assert _read_line(proc, 30.0) == "cleaning"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.split("\n")[:2] == ["cleaned up", f"signal {int(signal.SIGTERM)}"]
    assert proc.returncode == -signal.SIGTERM


# --------------------------------------------------------------------------- integration

# ``florg launch --ephemeral-superlink`` with the run replaced by a long wait: it prints the
# tag of the SuperLink it started, then waits to be killed.
LAUNCHER = """
import sys, time
import psutil
import florg_tools.launch as launch
from florg_tools.processes import TAG_ENV_VAR

def run_flower_app(*args, **kwargs):
    for child in psutil.Process().children():
        if "flower-superlink" in " ".join(child.cmdline()):
            print("TAG", child.environ()[TAG_ENV_VAR], flush=True)
    time.sleep(300)

launch.run_flower_app = run_flower_app
sys.exit(launch.main(sys.argv[1:]))
"""

# A pytest session whose one test holds a supervised SuperLink and sleeps.
INNER_TEST = """
import time
from florg_tools.superlink import local_simulation_superlink

def test_holds_a_superlink(tmp_path):
    with local_simulation_superlink(tmp_path / "sim", num_supernodes=1) as sim:
        print("TAG", sim.superlink.tag, flush=True)
        time.sleep(300)
"""


def _kill_and_check(starter: subprocess.Popen[str], sig: int, timeout: float = 60.0) -> None:
    """Once the starter's SuperLink and SuperExec run, kill the starter with ``sig`` and
    check that nothing it started (SuperLink, SuperExec, watchdog, ...) survives."""
    recorded: list[ProcInfo] = []
    tag = None
    try:
        tag = _read_line(starter, timeout, r"TAG (\w+)")
        # The SuperLink and the SuperExec it spawned in a session of its own.
        _wait_for(lambda: len(tagged_processes(tag)) >= 2, timeout, "the SuperExec")
        recorded = _tree_of(starter.pid, tag)
        assert any("flower-superexec" in p.cmdline for p in recorded), recorded
        os.kill(starter.pid, sig)
        _assert_nothing_survives(recorded, tag, timeout=20.0)
        assert starter.wait(timeout=20) == -sig
    finally:
        _stop(starter, recorded, tag)


@pytest.mark.integration
@pytest.mark.parametrize("sig", KILLS)
def test_a_killed_launcher_leaves_no_superlink_behind(tmp_path, sig):
    temp = tmp_path / "tmp"
    temp.mkdir()
    argv = ["--ephemeral-superlink", "--app", str(REPO), "--flwr-home", str(tmp_path / "home")]
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *argv, "--validate-with", "builtins:len", "--quiet"],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(temp), "FLWR_TELEMETRY_ENABLED": "0"},
        stdout=subprocess.PIPE,
        text=True,
    )
    _kill_and_check(launcher, sig)
    if sig == signal.SIGTERM:  # handled like Ctrl-C: its temporary Flower home is removed
        assert list(temp.iterdir()) == []


@pytest.mark.integration
def test_a_pytest_session_killed_from_outside_leaves_no_superlink_behind(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: not this conftest
    (inner / "test_inner.py").write_text(INNER_TEST)
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_inner.py"],
        cwd=inner,
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
        stdout=subprocess.PIPE,
        text=True,
    )
    _kill_and_check(session, signal.SIGTERM)  # what `timeout` sends first


# A starter of the private Docker engine (ci/docker_engine/): it starts dockerd (state dir
# argv[1], data-roots below argv[2]), prints the engine's tag and dockerd's pid, then
# waits to be killed.
DOCKERD_STARTER = """
import sys, time
from pathlib import Path
from ci.docker_engine import start_engine
engine = start_engine(Path(sys.argv[1]), Path(sys.argv[2]))
print("TAG", engine.tag, engine.pid, flush=True)
time.sleep(300)
"""

# A starter of the tests' private Ray cluster (tests/harness/ray_harness.py): a head node without
# CPUs (root argv[1]); it prints the head's tag, then waits to be killed.
RAY_STARTER = """
import sys, time
from pathlib import Path
from tests.harness.ray_harness import private_ray_cluster
with private_ray_cluster(Path(sys.argv[1]), head_cpus=0) as cluster:
    print("TAG", cluster.nodes[0].tag, flush=True)
    time.sleep(300)
"""


def _kill_server_starter(
    starter: subprocess.Popen[str], sig: int, expect: Callable[[list[ProcInfo]], object]
) -> list[ProcInfo]:
    """Once the starter printed its server's tag, record the starter's process tree and
    every process carrying the tag, check it with ``expect`` (the server is really up),
    kill the starter with ``sig`` and check that none of the recorded processes, and no
    process carrying the tag, survives. Returns what was recorded."""
    recorded: list[ProcInfo] = []
    tag = None
    try:
        tag = _read_line(starter, 180.0, r"TAG (\w+)")
        recorded = _tree_of(starter.pid, tag)
        assert expect(recorded), [p.cmdline[:100] for p in recorded]
        os.kill(starter.pid, sig)
        assert starter.wait(timeout=20) == -sig
        _assert_nothing_survives(recorded, tag, timeout=30.0)
        return recorded
    finally:
        _stop(starter, recorded, tag)


@pytest.mark.integration
@pytest.mark.parametrize("sig", KILLS)
def test_a_killed_starter_leaves_no_private_dockerd_behind(sig):
    from ci.docker_engine import engine_prerequisites, remove_tree, unmount_under

    problems = engine_prerequisites()
    if problems:
        message = "no private Docker engine here: " + "; ".join(problems)
        if CI:
            pytest.fail(message)
        pytest.skip(message)
    # Unix socket paths are short: the engine's state lives in /tmp, not in tmp_path. A
    # data-root of its own (empty: dockerd starts in seconds), not the image cache, which a
    # killed dockerd must not touch.
    root = Path(tempfile.mkdtemp(prefix="florg-dk-", dir="/tmp"))
    starter = subprocess.Popen(
        [sys.executable, "-c", DOCKERD_STARTER, str(root / "s"), str(root / "data")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )

    def dockerd_and_containerd(recorded: list[ProcInfo]) -> bool:
        # dockerd is the starter's child (unshare and sh exec it); containerd its child.
        table = {p.pid: p for p in recorded}
        dockerd = [p for p in recorded if p.ppid == starter.pid and "dockerd" in p.cmdline]
        return len(dockerd) == 1 and any(
            "containerd" in p.cmdline and p.ppid == dockerd[0].pid for p in table.values()
        )

    try:
        _kill_server_starter(starter, sig, dockerd_and_containerd)
    finally:
        unmount_under(root)
        remove_tree(root)


@pytest.mark.integration
@pytest.mark.parametrize("sig", KILLS)
def test_a_killed_starter_leaves_no_private_ray_cluster_behind(sig):
    # Ray's unix sockets live under its temp dir, whose path must stay short.
    root = Path(tempfile.mkdtemp(prefix="rayk-", dir="/tmp"))
    starter = subprocess.Popen(
        [sys.executable, "-c", RAY_STARTER, str(root)],
        cwd=REPO,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        stdout=subprocess.PIPE,
        text=True,
    )

    def head_services(recorded: list[ProcInfo]) -> bool:
        # `ray start --block` (the starter's child) and the head's GCS and raylet.
        commands = [p.cmdline for p in recorded]
        return all(any(name in c for c in commands) for name in ("gcs_server", "raylet"))

    try:
        _kill_server_starter(starter, sig, head_services)
    finally:
        shutil.rmtree(root, ignore_errors=True)
