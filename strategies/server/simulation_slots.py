"""The simulation engine's cap on ClientApp tasks at once (``simulation_task_slots``) and the
warning when an asynchronous run asks for more (``warn_simulation_slots``; docs/async.md)."""

from __future__ import annotations

import logging
import os

from flwr.serverapp import Grid

log = logging.getLogger("flwr.florg")


def simulation_task_slots() -> int:
    """The most ClientApp tasks Flower's simulation engine runs at once, whatever Ray's CPUs:
    its workers run in a ``ThreadPoolExecutor()`` made without ``max_workers``
    (flwr/server/superlink/fleet/vce/vce_api.py, ``run_api``), which Python sizes
    min(32, cpu count + 4); no Flower setting sizes it, and each worker keeps its thread for
    the whole run. The ServerApp of a simulation runs in the engine's process, so this is the
    engine's count."""
    return min(32, (os.cpu_count() or 1) + 4)


def warn_simulation_slots(grid: Grid, concurrency: int) -> bool:
    """Warn (and say so) when a simulation cannot keep ``concurrency`` clients training:
    more than ``simulation_task_slots``. A simulation is known by its grid: Flower's
    simulation engine alone hands the ServerApp an ``InMemoryGrid``."""
    from flwr.superlink.grid import InMemoryGrid

    slots = simulation_task_slots()
    if not isinstance(grid, InMemoryGrid) or concurrency <= slots:
        return False
    log.warning(
        "round-mode=async: async-concurrency %d exceeds the %d ClientApp tasks Flower's "
        "simulation engine runs at once here (its thread pool: min(32, %d CPUs + 4)); at most "
        "%d clients train or wait as stragglers at once, the others' tasks queue "
        "(docs/async.md)",
        concurrency, slots, os.cpu_count() or 1, slots,
    )  # fmt: skip
    return True
