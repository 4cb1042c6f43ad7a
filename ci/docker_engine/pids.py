"""Processes by pid (with a pid-reuse guard, from ``/proc``) and the mounts they leave:
what :meth:`PrivateDockerd.stop` signals, unmounts and removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ci.docker_engine.client import DockerEngineError


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # /proc/PID/stat field 22 (start time in clock ticks): pid-reuse guard
    cmdline: str


def proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of a live process, None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .strip()
        )
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def snapshot(roots: Sequence[int], marker: str) -> list[Proc]:
    """The processes ``roots`` and all their descendants, plus every process whose argv
    names ``marker`` (our exec-root: the containerd shims re-parent away from dockerd)."""
    table: dict[int, tuple[int, int, str]] = {}
    for pid in _all_pids():
        st = proc_stat(pid)
        if st is not None:
            table[pid] = st
    chosen = {pid for pid in roots if pid in table}
    chosen |= {pid for pid in table if marker and marker in _cmdline(pid)}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _start, _state) in table.items():
            if ppid in chosen and pid not in chosen:
                chosen.add(pid)
                changed = True
    return [Proc(pid, table[pid][1], _cmdline(pid)) for pid in sorted(chosen)]


def alive(proc: Proc) -> bool:
    st = proc_stat(proc.pid)
    return st is not None and st[1] == proc.start and st[2] not in ("Z", "X")


def send_signal(proc: Proc, sig: int) -> None:
    if alive(proc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == str(path) or point.startswith(prefix):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def unmount_under(path: Path) -> list[str]:
    """Lazily unmount everything mounted at or below ``path``; what is still mounted."""
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", point], capture_output=True)
    return _mounts_under(path)


def remove_tree(path: Path) -> None:
    """``rm -rf path``, but never through a mount point still below it."""
    if not path.exists():
        return
    left = unmount_under(path)
    if left:
        raise DockerEngineError(f"not removing {path}: still mounted below it: {left[:3]}")
    shutil.rmtree(path, ignore_errors=True)
