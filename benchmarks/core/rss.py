"""The process's resident memory on Linux, for the benchmarks' peak-memory columns.

``proc_status_kib("VmHWM")`` is the resident-set high-water mark and ``VmRSS`` the current
resident set, in KiB (``/proc/self/status``); ``reset_peak_rss`` sets the high-water mark
back to the current resident set (writing 5 to ``/proc/self/clear_refs``), so that a
peak measured after it is the peak of what ran since. It returns False where the kernel
refuses (the caller then reports no peak rather than a wrong one).
"""

from __future__ import annotations


def proc_status_kib(key: str) -> int:
    """The ``key`` line of /proc/self/status (``VmRSS``, ``VmHWM``...), in KiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where this kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
