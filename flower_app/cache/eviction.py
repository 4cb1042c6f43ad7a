"""Keep the derived cache (flower_app/cache/disk.py) under its size limit,
``$FLORG_DERIVED_CACHE_MAX_MB`` (default 4096): after a store that may have taken it past
the limit, delete the least recently used entries (a hit refreshes an entry's mtime) until
it is at 90% of the limit. Entries are the folders and files directly under the cache's
``models/`` and ``tokenized/``; names starting with a dot are writes in progress."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from pathlib import Path

__all__ = ["DEFAULT_MAX_MB", "MAX_MB_ENV_VAR", "evict"]

MAX_MB_ENV_VAR = "FLORG_DERIVED_CACHE_MAX_MB"
DEFAULT_MAX_MB = 4096.0

# Bytes of each entry this process has measured. An entry never changes once renamed into
# place (writes go to a temporary name first; its name is the hash of everything its
# content depends on, so one rebuilt under it holds the same), so its size is measured
# once: the eviction scan then costs one stat per entry instead of a walk of every entry's
# files (with a thousand simulated clients' partitions cached, that walk was the largest
# cost of a client's round outside training: py-spy over benchmarks.scale.scale_benchmark).
_SIZES: dict[Path, int] = {}


def _entry_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _known_size(entry: Path) -> int:
    """``_entry_size`` of ``entry``, measured once by this process."""
    size = _SIZES.get(entry)
    if size is None:
        size = _SIZES[entry] = _entry_size(entry)
    return size


# After a scan that evicted, the cache is left at this fraction of its limit, so that the
# stores that follow need no scan until they have filled the rest.
_LOW_WATER = 0.9
# A scan's total is trusted this long (other processes store into the same folder too).
_SCAN_TTL_SECONDS = 60.0
# root -> (the total bytes after this process's last scan plus what it stored since, when
# that scan ran): see ``_evict``.
_SCANNED: dict[Path, tuple[float, float]] = {}


def _limit_bytes() -> float:
    try:
        return float(os.environ.get(MAX_MB_ENV_VAR, DEFAULT_MAX_MB)) * 1e6
    except ValueError:
        return DEFAULT_MAX_MB * 1e6


def evict(root: Path, keep: Path) -> None:
    """After storing ``keep``: when the cache may exceed its size limit, delete least
    recently used entries until it is at ``_LOW_WATER`` of the limit.

    The scan (a stat of every entry) is skipped while this process's last scan, younger
    than ``_SCAN_TTL_SECONDS``, plus the bytes it stored since stays within the limit: with
    a thousand simulated clients storing their partitions, a scan per store was a cost of
    every client's round."""
    limit = _limit_bytes()
    added = _known_size(keep) if keep.exists() else 0
    total, at = _SCANNED.get(root, (math.inf, 0.0))
    now = time.monotonic()
    if total + added <= limit and now - at < _SCAN_TTL_SECONDS:
        _SCANNED[root] = (total + added, at)
        return
    entries = []
    for kind in ("models", "tokenized"):
        folder = root / kind
        if folder.is_dir():
            for entry in folder.iterdir():
                if not entry.name.startswith("."):  # skip writes in progress
                    with contextlib.suppress(OSError):
                        entries.append((entry.stat().st_mtime, _known_size(entry), entry))
    total = sum(size for _, size, _ in entries)
    if total > limit:
        for _, size, entry in sorted(entries, key=lambda e: e[0]):
            if total <= _LOW_WATER * limit:
                break
            if entry == keep:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
            _SIZES.pop(entry, None)
            total -= size
    _SCANNED[root] = (total, now)
