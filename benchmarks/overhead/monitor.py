"""Simulation overhead: CPU time of the simulation's processes and of the machine
(psutil; processes named by pid and start time as ``florg_tools.processes`` records them),
and the monitor thread that places the run's rows on this process's clock."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from florg_tools.processes import ProcInfo


def child_pids(pid: int) -> list[int]:
    """The pids of the direct children of ``pid`` (none if it is gone)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def cpu_seconds(info: ProcInfo) -> float | None:
    """User + system CPU seconds of the process ``info`` (``None`` once it is gone, a
    zombie, or another process with its pid: the start time tells them apart)."""
    import psutil

    from florg_tools.processes import process_info

    now = process_info(info.pid)
    if now is None or now.zombie or not now.same_process(info):
        return None
    try:
        times = psutil.Process(info.pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of ``pid`` (empty if it is gone)."""
    import psutil

    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.Error:
        return {}


def busy_threads(before: dict[int, float], after: dict[int, float]) -> int:
    """Threads that did real work between two ``thread_cpu_seconds`` samples (>= 25% of the
    busiest thread's CPU and >= 50 ms): torch's OpenMP workers show up here."""
    deltas = [cpu - before.get(tid, 0.0) for tid, cpu in after.items()]
    top = max(deltas, default=0.0)
    return sum(1 for d in deltas if d >= max(0.05, 0.25 * top))


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, non-idle), from /proc/stat."""
    import psutil

    try:
        t = psutil.cpu_times()
    except (psutil.Error, OSError):
        return float("nan")
    # everything but idle and iowait (guest is included in user)
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def foreign_cores(busy_s: float, own_cpu_s: float, wall_s: float) -> float:
    """Average number of cores busy with work other than ours over an interval."""
    return max(0.0, busy_s - own_cpu_s) / wall_s if wall_s > 0 else float("nan")


CATEGORIES = (
    "ray actors (ClientApps)",
    "flwr-simulation (ServerApp + Ray driver)",
    "ray services",
    "superlink + superexec",
    "flwr CLI (launcher)",
    "other",
)


def categorise(cmdline: str) -> str:
    if cmdline.startswith("ray::"):
        return CATEGORIES[0]
    if "flwr-simulation" in cmdline:
        return CATEGORIES[1]
    if any(s in cmdline for s in ("raylet", "gcs_server", "/ray/", "dashboard", "log_monitor")):
        return CATEGORIES[2]
    if "flower-superlink" in cmdline or "flower-superexec" in cmdline:
        return CATEGORIES[3]
    if "flwr" in cmdline:
        return CATEGORIES[4]
    return CATEGORIES[5]


@dataclass
class RowSeen:
    row: dict[str, Any]
    seen: float  # perf_counter of this process when the row was first read
    cpu: dict[str, float]  # cumulative CPU seconds per category at that moment
    busy: float  # machine_busy_s() at that moment
    own: float  # this process's CPU seconds (monitor, SuperLink tracker, launcher)
    threads: dict[tuple[int, float], dict[int, float]]  # ServerApp + actors: thread CPU


class SimMonitor(threading.Thread):
    """Watches the run folder (ServerApp start, metrics rows) and the simulation's CPU."""

    def __init__(self, run_dir: Path, superlink: Any, poll: float = 0.05, cpu_every: float = 1.0):
        super().__init__(name="sim-monitor", daemon=True)
        self.run_dir = run_dir
        self.superlink = superlink
        self.poll = poll
        self.cpu_every = cpu_every
        self.config_seen: float | None = None
        self.metrics_seen: float | None = None
        self.rows: list[RowSeen] = []
        self._cpu: dict[tuple[int, float], float] = {}
        self._cat: dict[tuple[int, float], str] = {}
        self._stop_event = threading.Event()
        self.error: BaseException | None = None

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10.0)

    def sample_cpu(self) -> dict[str, float]:
        from florg_tools.processes import process_info

        pids = {info.pid for info in self.superlink.recorded()}
        pids.update(child_pids(os.getpid()))
        for pid in pids:
            # re-read: a Ray worker renames itself once it hosts an actor
            info = process_info(pid)
            cpu = None if info is None or info.zombie else cpu_seconds(info)
            if info is None or cpu is None:
                continue
            if info.cmdline:
                self._cat[info.key] = categorise(info.cmdline)
            self._cpu[info.key] = max(self._cpu.get(info.key, 0.0), cpu)
        totals = dict.fromkeys(CATEGORIES, 0.0)
        for key, cpu in self._cpu.items():
            totals[self._cat.get(key, CATEGORIES[5])] += cpu
        return totals

    def sample_threads(self) -> dict[tuple[int, float], dict[int, float]]:
        watched = (CATEGORIES[0], CATEGORIES[1])
        sampled = {key: thread_cpu_seconds(key[0]) for key, c in self._cat.items() if c in watched}
        return {key: threads for key, threads in sampled.items() if threads}  # live ones

    def category(self, key: tuple[int, float]) -> str:
        return self._cat.get(key, CATEGORIES[5])

    def run(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        last_cpu = 0.0
        try:
            while not self._stop_event.is_set():
                now = time.perf_counter()
                if self.config_seen is None and (self.run_dir / "config.json").exists():
                    self.config_seen = now
                new_rows: list[dict[str, Any]] = []
                if metrics.exists():
                    if self.metrics_seen is None:
                        self.metrics_seen = now
                    with contextlib.suppress(OSError):
                        lines = metrics.read_text().split("\n")[:-1]  # complete lines only
                        new_rows = [json.loads(ln) for ln in lines[len(self.rows) :] if ln]
                if new_rows or now - last_cpu >= self.cpu_every:
                    totals = self.sample_cpu()
                    last_cpu = time.perf_counter()
                    busy, own = machine_busy_s(), time.process_time()
                    threads = self.sample_threads() if new_rows else {}
                    for row in new_rows:
                        self.rows.append(RowSeen(row, now, totals, busy, own, threads))
                self._stop_event.wait(self.poll)
        except BaseException as err:  # reported by the caller; never kill the run
            self.error = err
