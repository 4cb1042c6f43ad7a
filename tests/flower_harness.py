"""Test helpers: a private simulation SuperLink per test, and leak checks.

Not a test module (pytest collects only ``test_*.py``; ``__test__`` says so too).

``local_simulation_superlink`` (``florg_tools.superlink``) starts ``flower-superlink
--simulation`` on a free port with its own ``FLWR_HOME`` (so concurrent tests never share
ports, state or installed apps), writes a connection pointing at it, and on exit -- also
when the test failed -- stops it and every process it spawned (SuperExec,
``flwr-simulation``, the Ray cluster), then checks that none of the processes it recorded
while the SuperLink was up is still alive (``florg_tools.processes``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from florg_tools.flwr_cli import RunOutcome, run_flower_app
from florg_tools.processes import LeakedProcessesError, ProcInfo, still_alive
from florg_tools.superlink import SimulationSuperLink, local_simulation_superlink

__test__ = False  # not a test module

__all__ = [
    "LeakedProcessesError",
    "SimulationSuperLink",
    "live_processes",
    "local_simulation_superlink",
    "run_app_in_simulation",
]


def live_processes(recorded: Iterable[ProcInfo], tag: str | None = None) -> list[str]:
    """Descriptions (``"PID: command"``) of the ``recorded`` processes still alive (same pid
    and start time, not a zombie), plus any process carrying the tag ``tag``."""
    return [f"{p.pid}: {p.cmdline[:160]}" for p in still_alive(recorded, tag)]


def run_app_in_simulation(
    app_dir: Path,
    run_config: Mapping[str, Any] | None = None,
    num_supernodes: int = 2,
    tmp_dir: Path | None = None,
    timeout: float = 300.0,
    **run_kwargs: Any,
) -> RunOutcome:
    """Run a Flower App through the real simulation engine on a private SuperLink.

    ``run_kwargs`` go to ``florg_tools.flwr_cli.run_flower_app`` (``validate``, ``stream``,
    ...). Raises ``LeakedProcessesError`` if any spawned process outlives the run.
    """

    def run(tmp: Path) -> RunOutcome:
        with local_simulation_superlink(tmp, num_supernodes) as (home, connection):
            return run_flower_app(
                app_dir, connection, run_config or {}, home, timeout, **run_kwargs
            )

    if tmp_dir is not None:
        return run(Path(tmp_dir))
    with tempfile.TemporaryDirectory(prefix="flwr-sim-") as tmp:
        return run(Path(tmp))
