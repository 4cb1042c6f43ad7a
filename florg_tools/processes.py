"""One process supervisor (psutil): process table, descendants, start-time-safe identity,
stopping a process tree by pid, and finding the processes that carry a tag.

A process is identified by its pid and its start time (``ProcInfo.key``), so a process
that reuses the pid is never signalled. Processes started with ``spawn`` get a unique
environment tag (``TAG_ENV_VAR``, inherited by everything they spawn), which finds them
even after they re-parent to init; nothing is found or killed by name. ``TrackedProcess``
follows one started process, its descendants and its tag in the background; ``stop()``
ends them all (SIGTERM, then SIGKILL). Nothing ``spawn`` starts outlives its starter, even
one killed by SIGKILL: a parent-death signal and a watchdog (``spawn`` says how).
``signals_interrupt`` turns SIGTERM / SIGHUP into ``KeyboardInterrupt`` for a graceful
stop; ``die_by_signal`` then ends the process by that signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = [
    "TAG_ENV_VAR",
    "LeakedProcessesError",
    "ProcInfo",
    "ReceivedSignal",
    "TrackedProcess",
    "descendants",
    "die_by_signal",
    "is_alive",
    "process_info",
    "process_table",
    "signals_interrupt",
    "spawn",
    "still_alive",
    "tagged_processes",
    "terminate_tree",
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
        survivors = self.survivors()
        if self.tag:
            _release_watchdog(self.tag)  # it sweeps the tag once more, then exits
        return survivors


def spawn(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path | None = None,
    header: bool = False,
    die_with_starter: bool = True,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``command`` in a new session with a fresh tag added to ``env``, stdin from
    ``/dev/null`` and stdout + stderr appended to ``log_path`` (after a ``$ command`` line
    with ``header``); returns the process and its tag.

    With ``die_with_starter`` (the default) nothing started outlives this process (the
    *starter*), also when it is killed from outside (SIGTERM from ``timeout``, or SIGKILL,
    which no handler sees), through two mechanisms:

    * **a parent-death signal** on the started process itself: ``prctl(PR_SET_PDEATHSIG,
      SIGKILL)`` (Linux, through ctypes on libc) in a ``preexec_fn``, so the kernel kills it
      the moment its starter dies. It covers the direct child only, and it fires when the
      *thread* that forked dies, so it is set only when ``spawn`` runs on the main thread
      (a worker thread that ends would otherwise kill a SuperLink that should live on);
    * **a watchdog**: a small Python process (``_watchdog_main``; stdlib + psutil only) in
      its own session, so that signals sent to the starter's process group (``timeout``,
      Ctrl-C) do not reach it. It holds the read end of a pipe whose write end only the
      starter holds (close-on-exec: no program the starter executes inherits it). When the
      starter dies, however it dies, the kernel closes that end and the watchdog reads EOF
      (it also checks every second that its parent is still the starter, for a write end
      kept open by a ``fork`` without ``exec``). It then stops every process carrying the
      tag plus the started process, the members of its process group (re-parented ones
      included) and their descendants (SIGTERM, SIGKILL after 3 s, by pid and by process
      group: ``_signal_until_gone``), which reaches the grandchildren PDEATHSIG cannot
      (``flower-superexec`` in its own session, ``flwr-simulation``, Ray's services), and
      exits. SIGTERM to the watchdog itself (an outer tracker stopping the starter's tree:
      the watchdog carries the starter's own tag) also makes it sweep before it exits.

    ``TrackedProcess.stop()`` releases the watchdog (closes the pipe: it finds nothing left
    and exits; it is reaped); a watchdog whose process and tagged processes have all exited
    while the starter lives ends by itself."""
    tag = uuid.uuid4().hex
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _reap_watchdogs()
    watchdog = _start_watchdog(tag, log_path) if die_with_starter else None
    preexec = _parent_death_signal(os.getpid()) if die_with_starter else None
    try:
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
                preexec_fn=preexec,  # prctl only (see _parent_death_signal)
            )
    except BaseException:
        if watchdog is not None:
            _close_watchdog(watchdog)
        raise
    if watchdog is not None:
        with contextlib.suppress(OSError, ValueError):  # a watchdog that died: no pipe
            assert watchdog.stdin is not None
            watchdog.stdin.write(f"{popen.pid}\n".encode())
            watchdog.stdin.flush()
        with _watchdogs_lock:
            _watchdogs[tag] = watchdog
    return popen, tag


# --------------------------------------------------------------------------------------
# A graceful stop on SIGTERM in the starter


@dataclass
class ReceivedSignal:
    """What ``signals_interrupt`` caught: the first signal's number, or ``None``."""

    signum: int | None = None


@contextlib.contextmanager
def signals_interrupt(
    signums: Sequence[int] = (signal.SIGTERM, signal.SIGHUP),
) -> Iterator[ReceivedSignal]:
    """Within the block, the first of ``signums`` raises ``KeyboardInterrupt`` (recorded
    in the yielded ``ReceivedSignal``), so ``finally`` blocks and context managers stop
    what was started, as on Ctrl-C. Later ones are ignored, so as not to cut that cleanup
    short: GNU ``timeout`` sends its signal twice, to the process and to its group (a
    stuck cleanup still ends with SIGKILL, and the watchdogs then stop what is left).
    The default handlers come back on exit. Only signals whose handler is the default are
    taken over; off the main thread nothing is. Call ``die_by_signal(received.signum)``
    after the block to end as the signal would have.
    """
    received = ReceivedSignal()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: object) -> None:
        if received.signum is None:
            received.signum = signum
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    taken: list[int] = []
    try:
        for sig in signums:
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, handler)
                taken.append(sig)
        yield received
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)


def die_by_signal(signum: int) -> int:
    """End this process with ``signum``'s default action (the exit status a parent sees
    for a process killed by it); returns ``128 + signum`` if it is blocked."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(0.1)
    return 128 + signum


# --------------------------------------------------------------------------------------
# Dying with the starter: parent-death signal and watchdog (``spawn``'s docstring)

_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL = 1.0  # seconds between the watchdog's checks of its parent
_IDLE_SCAN_INTERVAL = 5.0  # between its scans for tagged orphans once the process exited


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    return prctl


_PRCTL = _load_prctl()


def _parent_death_signal(starter: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGKILL when the thread that forks it
    dies (``None`` off Linux, or off the main thread, whose end is not the starter's).
    It runs between fork and exec: one foreign call, no allocation-heavy Python, no
    locks; a starter that died before the call is caught by comparing the parent pid."""
    prctl = _PRCTL
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    kill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != starter:  # the starter died before prctl took effect
            os.kill(os.getpid(), kill)

    return preexec


_watchdogs: dict[str, subprocess.Popen[bytes]] = {}
_watchdogs_lock = threading.Lock()


def _start_watchdog(tag: str, log_path: Path) -> subprocess.Popen[bytes] | None:
    """Start the watchdog of ``tag`` (``None`` if it cannot be started: the process then
    only has its parent-death signal). Its stderr goes to ``log_path``, where it reports
    what it had to stop."""
    package_root = str(Path(__file__).resolve().parent.parent)
    code = (
        f"import sys; sys.path.append({package_root!r}); "
        "from florg_tools.processes import _watchdog_main; _watchdog_main()"
    )
    try:
        with log_path.open("ab") as log_file:
            return subprocess.Popen(
                [sys.executable, "-c", code, tag, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                start_new_session=True,  # out of the starter's group: its signals miss us
            )
    except OSError:
        return None


def _close_watchdog(watchdog: subprocess.Popen[bytes], wait: float = 20.0) -> None:
    """Close the pipe (the watchdog sweeps its tag and exits) and reap it."""
    with contextlib.suppress(OSError, ValueError):
        if watchdog.stdin is not None:
            watchdog.stdin.close()
    try:
        watchdog.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _release_watchdog(tag: str, wait: float = 20.0) -> None:
    with _watchdogs_lock:
        watchdog = _watchdogs.pop(tag, None)
    if watchdog is not None:
        _close_watchdog(watchdog, wait)


def _reap_watchdogs() -> None:
    """Reap the watchdogs that ended by themselves (what they guarded exited)."""
    with _watchdogs_lock:
        done = [tag for tag, w in _watchdogs.items() if w.poll() is not None]
        finished = [_watchdogs.pop(tag) for tag in done]
    for watchdog in finished:
        _close_watchdog(watchdog)


class _Sweep(BaseException):
    """Raised in the watchdog by SIGTERM: stop everything now."""


def _watch(tag: str, starter: int, recorded: dict[int, ProcInfo]) -> str | None:
    """Wait until the starter is gone (the reason) or nothing is left to guard (``None``);
    records the pids the starter writes to stdin."""
    fd = sys.stdin.fileno()
    buffer = b""
    announced = False
    next_scan = 0.0
    try:
        while True:
            if os.getppid() != starter:
                return f"its starter (pid {starter}) died"
            ready, _, _ = select.select([fd], [], [], _WATCH_INTERVAL)
            if ready:
                data = os.read(fd, 4096)
                if not data:
                    return f"its starter (pid {starter}) exited or released it"
                *lines, buffer = (buffer + data).split(b"\n")
                for line in lines:
                    announced = True  # (one that already exited cannot be read any more)
                    info = process_info(int(line)) if line.strip().isdigit() else None
                    if info is not None:
                        recorded[info.pid] = info
                continue
            if not announced or any(is_alive(info) for info in recorded.values()):
                continue
            if time.monotonic() >= next_scan:
                if not tagged_processes(tag):
                    return None
                next_scan = time.monotonic() + _IDLE_SCAN_INTERVAL
    except _Sweep:
        return "it was sent SIGTERM"


def _sweep(
    tag: str, recorded: Mapping[int, ProcInfo], timeout: float = 15.0
) -> tuple[int, list[ProcInfo]]:
    """Stop every process carrying ``tag``, the ``recorded`` ones and the members of their
    process groups, each with its descendants; (how many were found alive, the
    survivors)."""
    seen: dict[int, ProcInfo] = dict(recorded)
    found: set[tuple[int, float]] = set()
    # spawn starts each recorded process in a session, and so a process group, of its own,
    # whose id is its pid. The kernel hands out no pid still in use as a group id, so a
    # process of such a group is one the started process spawned, even after the started
    # process died.
    groups = {rec.pid for rec in recorded.values()}

    def find_alive() -> list[ProcInfo]:
        table = process_table(tag)
        # Not every process a started process spawned shows the tag or stays in its tree.
        # One that sets its title over its environment (Ray's "ray::..." agents and
        # workers) has no environment left to read; once its parent died (Ray's services
        # share the fate of `ray start`, which the parent-death signal kills) it re-parents
        # to init. Members of the started processes' groups, and the children of every
        # tagged process (a container under its containerd shim), are roots too.
        for info in table.values():
            if info.pgid in groups or info.tagged:
                seen[info.pid] = info
        for root in list(seen.values()):
            now = table.get(root.pid)
            if now is not None and now.same_process(root):
                for info in descendants(table, root.pid):
                    seen.setdefault(info.pid, info)
        alive = {
            pid: table[pid]
            for pid, rec in seen.items()
            if pid in table and table[pid].same_process(rec) and not table[pid].zombie
        }
        for info in tagged_processes(tag, table):
            alive[info.pid] = info
        alive.pop(os.getpid(), None)
        found.update(info.key for info in alive.values())
        return list(alive.values())

    survivors = _signal_until_gone(find_alive, timeout)
    return len(found), survivors


def _watchdog_main() -> None:
    """The watchdog (``python -c ... TAG STARTER_PID``; stdin: the starter's pipe, stderr:
    the started process's log)."""
    tag, starter = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watching = [True]

    def on_sigterm(signum: int, frame: object) -> None:
        if watching[0]:  # later ones: the sweep is already under way
            watching[0] = False
            raise _Sweep

    signal.signal(signal.SIGTERM, on_sigterm)
    recorded: dict[int, ProcInfo] = {}
    reason = _watch(tag, starter, recorded)
    watching[0] = False
    if reason is None:
        return
    count, survivors = _sweep(tag, recorded)
    if count:
        message = f"[watchdog {os.getpid()}] {reason}: stopped {count} process(es) it started"
        if survivors:
            message += "; still alive: " + ", ".join(
                f"{p.pid} ({p.cmdline[:60]})" for p in survivors
            )
        print(message, file=sys.stderr, flush=True)
