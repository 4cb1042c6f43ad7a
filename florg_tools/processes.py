"""One process supervisor (psutil): process table, descendants, start-time-safe identity,
stopping a process tree by pid, and finding the processes that carry a tag.

A process is identified by its pid *and* its start time (``ProcInfo.key``), so a later
process that reuses the pid is never mistaken for it (and never signalled). Processes we
start get a unique environment tag (``TAG_ENV_VAR``, inherited by everything they spawn),
which finds them again even after they re-parent to init (Ray's services, the SuperExec's
children). Nothing is ever found or killed by name.

``TrackedProcess`` follows one started process: it, its descendants and every process
carrying its tag, sampled in the background so that short-lived children are recorded
too; ``stop()`` ends them all (SIGTERM, then SIGKILL) and returns the survivors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = [
    "TAG_ENV_VAR",
    "LeakedProcessesError",
    "ProcInfo",
    "TrackedProcess",
    "children",
    "cpu_seconds",
    "descendants",
    "is_alive",
    "process_info",
    "process_table",
    "spawn",
    "still_alive",
    "tagged_processes",
    "terminate_tree",
    "thread_cpu_seconds",
]

TAG_ENV_VAR = "FLORG_SUPERLINK_TAG"

# Two readings of one process's start time differ by less than this (the kernel's boot
# time, to which the start tick is added, moves when the wall clock is stepped).
_SAME_START = 1.0


class LeakedProcessesError(AssertionError):
    """Processes we started outlived their shutdown."""


@dataclass(frozen=True)
class ProcInfo:
    """One process. ``start_time`` (seconds since the epoch, psutil's ``create_time()``)
    tells it apart from a later process that reuses the pid."""

    pid: int
    ppid: int
    pgid: int
    start_time: float
    zombie: bool
    cmdline: str
    tagged: bool

    @property
    def key(self) -> tuple[int, float]:
        return (self.pid, self.start_time)

    def same_process(self, other: ProcInfo) -> bool:
        """Whether ``other`` is a reading of this very process (same pid and start time)."""
        return self.pid == other.pid and abs(self.start_time - other.start_time) < _SAME_START


def _read(proc: psutil.Process, tag: str | None) -> ProcInfo | None:
    try:
        with proc.oneshot():
            tagged = False
            if tag:
                # Unreadable environments (other users', kernel threads) carry no tag.
                with contextlib.suppress(psutil.Error, OSError):
                    tagged = proc.environ().get(TAG_ENV_VAR) == tag
            return ProcInfo(
                pid=proc.pid,
                ppid=proc.ppid(),
                pgid=os.getpgid(proc.pid),
                start_time=proc.create_time(),
                zombie=proc.status() == psutil.STATUS_ZOMBIE,
                cmdline=" ".join(proc.cmdline()),
                tagged=tagged,
            )
    except (psutil.Error, OSError):
        return None


def process_info(pid: int, tag: str | None = None) -> ProcInfo | None:
    """The process ``pid`` now (``None`` if there is none or it cannot be read)."""
    try:
        return _read(psutil.Process(pid), tag)
    except psutil.Error:
        return None


def process_table(tag: str | None = None) -> dict[int, ProcInfo]:
    """Every visible process by pid; ``ProcInfo.tagged`` marks the ones carrying ``tag``."""
    table: dict[int, ProcInfo] = {}
    for pid in psutil.pids():
        # A fresh Process per pid (not process_iter's cache, whose entry for a reused pid
        # would still carry the old process's start time).
        info = process_info(pid, tag)
        if info is not None:
            table[info.pid] = info
    return table


def descendants(table: Mapping[int, ProcInfo], root: int) -> list[ProcInfo]:
    """The processes of ``table`` below ``root`` (children, grandchildren, ...)."""
    kids: dict[int, list[int]] = {}
    for info in table.values():
        kids.setdefault(info.ppid, []).append(info.pid)
    found: list[ProcInfo] = []
    todo = list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in table:
            found.append(table[pid])
            todo.extend(kids.get(pid, []))
    return found


def children(pid: int) -> list[int]:
    """The pids of the direct children of ``pid`` (none if it is gone)."""
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def is_alive(info: ProcInfo) -> bool:
    """Whether the process ``info`` describes still runs (same pid and start time, and not
    a zombie)."""
    now = process_info(info.pid)
    return now is not None and now.same_process(info) and not now.zombie


def tagged_processes(tag: str, table: Mapping[int, ProcInfo] | None = None) -> list[ProcInfo]:
    """Live (non-zombie) processes carrying ``tag``, this process excluded."""
    table = process_table(tag) if table is None else table
    return [
        info
        for info in table.values()
        if info.tagged and not info.zombie and info.pid != os.getpid()
    ]


def still_alive(recorded: Iterable[ProcInfo], tag: str | None = None) -> list[ProcInfo]:
    """The ``recorded`` processes that still run (same pid and start time, not a zombie),
    plus every live process carrying ``tag``; this process excluded; sorted by pid."""
    table = process_table(tag)
    alive: dict[int, ProcInfo] = {}
    for rec in recorded:
        now = table.get(rec.pid)
        if now is not None and now.same_process(rec) and not now.zombie:
            alive[rec.pid] = rec
    if tag:
        for info in tagged_processes(tag, table):
            alive[info.pid] = info
    alive.pop(os.getpid(), None)
    return sorted(alive.values(), key=lambda i: i.pid)


def cpu_seconds(info: ProcInfo) -> float | None:
    """User + system CPU seconds of the process ``info`` (``None`` once it is gone, a
    zombie, or another process with its pid)."""
    try:
        proc = psutil.Process(info.pid)
        with proc.oneshot():
            if abs(proc.create_time() - info.start_time) >= _SAME_START:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of ``pid`` (empty if it is gone)."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.Error:
        return {}


def _signal_until_gone(
    find_alive: Callable[[], Sequence[ProcInfo]],
    timeout: float,
    recheck: Callable[[], Sequence[ProcInfo]] | None = None,
) -> list[ProcInfo]:
    """SIGTERM what ``find_alive`` returns -- by pid, and by process group for groups led by
    one of them (never our own) -- wait up to 3 s (polling ``recheck``, default
    ``find_alive``), then SIGKILL, until nothing is left or ``timeout`` passes; return the
    survivors."""
    recheck = recheck or find_alive
    deadline = time.monotonic() + timeout
    sig = signal.SIGTERM
    own_group = os.getpgrp()
    while True:
        alive = list(find_alive())
        if not alive or time.monotonic() >= deadline:
            return alive
        for info in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(info.pid, sig)
            if info.pgid == info.pid and info.pgid != own_group:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(info.pgid, sig)
        wait_until = min(deadline, time.monotonic() + (3.0 if sig == signal.SIGTERM else 1.0))
        while time.monotonic() < wait_until and recheck():
            time.sleep(0.1)
        sig = signal.SIGKILL


def terminate_tree(pid: int, timeout: float = 15.0) -> list[ProcInfo]:
    """Stop the process ``pid`` and its descendants: SIGTERM, then SIGKILL after 3 s, until
    none is left or ``timeout`` passes; the survivors (empty on success). Processes are
    remembered by pid and start time, so a reused pid is never signalled. A child of this
    process still has to be reaped by its owner (``Popen.wait``)."""
    table = process_table()
    if pid not in table:
        return []
    tree = [table[pid], *descendants(table, pid)]

    def find_alive() -> list[ProcInfo]:
        now = process_table()
        members = {info.pid: info for info in tree}
        for info in descendants(now, pid):
            members.setdefault(info.pid, info)
        return [
            now[p]
            for p, rec in members.items()
            if p in now and now[p].same_process(rec) and not now[p].zombie
        ]

    return _signal_until_gone(find_alive, timeout)


class TrackedProcess:
    """A process we started (``popen``) and everything it spawns: its descendants and
    every process carrying ``tag`` in its environment (``None``: descendants only)."""

    def __init__(self, popen: subprocess.Popen[bytes], tag: str | None, log_path: Path) -> None:
        self.popen = popen
        self.tag = tag
        self.log_path = log_path
        self._recorded: dict[tuple[int, float], ProcInfo] = {}
        self._lock = threading.Lock()
        self._tracker: threading.Thread | None = None
        self._tracking = threading.Event()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def scan(self) -> list[ProcInfo]:
        """Live (non-zombie) processes of this tree: the process, its descendants, and
        every process carrying the tag; all of them are also recorded."""
        table = process_table(self.tag)
        found = {info.pid: info for info in table.values() if info.tagged}
        if self.pid in table:
            found[self.pid] = table[self.pid]
        for info in descendants(table, self.pid):
            found[info.pid] = info
        live = [info for info in found.values() if not info.zombie]
        with self._lock:
            for info in live:
                self._recorded.setdefault(info.key, info)
        return live

    def recorded(self) -> list[ProcInfo]:
        """Every process seen so far (including the ones that have exited since)."""
        with self._lock:
            return list(self._recorded.values())

    def start_tracking(self, interval: float = 0.25) -> None:
        """Sample the process tree in the background so short-lived children get recorded."""
        if self._tracker is not None:
            return
        self._tracking.set()

        def loop() -> None:
            while self._tracking.is_set():
                with contextlib.suppress(Exception):
                    self.scan()
                time.sleep(interval)

        self._tracker = threading.Thread(target=loop, name="process-tracker", daemon=True)
        self._tracker.start()

    def stop_tracking(self) -> None:
        self._tracking.clear()
        if self._tracker is not None:
            self._tracker.join(timeout=5.0)
            self._tracker = None

    def survivors(self) -> list[ProcInfo]:
        """Recorded or tagged processes that are still alive (same pid *and* start time)."""
        alive = {info.pid: info for info in still_alive(self.recorded(), self.tag)}
        if self.popen.poll() is None:
            now = process_info(self.pid)
            if now is not None:
                alive[self.pid] = now
        alive.pop(os.getpid(), None)
        return sorted(alive.values(), key=lambda i: i.pid)

    def stop(self, grace: float = 5.0, kill_timeout: float = 15.0) -> list[ProcInfo]:
        """Stop the process and everything it spawned; return what survived (empty on
        success). SIGTERM to the process first (a SuperLink stops its SuperExec, which stops
        ``flwr-simulation`` and Ray) and ``grace`` seconds for it to exit, then SIGTERM and
        finally SIGKILL to the rest, by pid and by process group (only groups led by one
        of these processes)."""
        self.stop_tracking()
        self.scan()
        if self.popen.poll() is None:
            self.popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace)

        def find_alive() -> list[ProcInfo]:
            self.scan()
            return self.survivors()

        _signal_until_gone(find_alive, kill_timeout, recheck=self.survivors)
        if self.popen.poll() is None:
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        return self.survivors()


def spawn(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path | None = None,
    header: bool = False,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``command`` in a new session with a fresh tag added to ``env``, stdin from
    ``/dev/null`` and stdout + stderr appended to ``log_path`` (after a ``$ command`` line
    with ``header``); returns the process and its tag."""
    tag = uuid.uuid4().hex
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        if header:
            log_file.write(f"$ {' '.join(command)}\n".encode())
            log_file.flush()
        popen = subprocess.Popen(
            list(command),
            env={**env, TAG_ENV_VAR: tag},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return popen, tag
