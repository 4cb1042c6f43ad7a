"""Test helpers: a private simulation SuperLink per test, leak checks, and the app's runs on
the tiny model.

Not a test module (pytest collects only ``test_*.py``; ``__test__`` says so too).

``local_simulation_superlink`` (``florg_tools.superlink``) starts ``flower-superlink
--simulation`` on a free port with its own ``FLWR_HOME`` (so concurrent tests never share
ports, state or installed apps), writes a connection pointing at it, and on exit -- also
when the test failed -- stops it and every process it spawned (SuperExec,
``flwr-simulation``, the Ray cluster), then checks that none of the processes it recorded
while the SuperLink was up is still alive (``florg_tools.processes``).

``run_tiny_app`` runs this checkout's app on the tiny BERT and the synthetic sentiment task
through a module's shared SuperLink (the fixtures ``tiny_assets`` and ``tiny_superlink`` of
tests/conftest.py), with the settings the integration modules have in common.
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
    "TINY_NUM_NODES",
    "TINY_RANK",
    "LeakedProcessesError",
    "SimulationSuperLink",
    "live_processes",
    "local_simulation_superlink",
    "run_app_in_simulation",
    "run_tiny_app",
]

APP = Path(__file__).resolve().parents[2]  # this checkout's Flower App
# The tiny runs' federation: SuperNodes of the shared SuperLink, all of them in every round,
# and the adapters' rank.
TINY_NUM_NODES = 3
TINY_RANK = 2


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


def run_tiny_app(
    superlink: SimulationSuperLink,
    assets: tuple[Path, Path, Path],
    name: str,
    **settings: Any,
) -> tuple[RunOutcome, Path]:
    """Run the app on the tiny BERT and the sentiment task through ``superlink`` (conftest's
    ``tiny_superlink``): 2 rounds over all ``TINY_NUM_NODES`` nodes at rank ``TINY_RANK``,
    lr 0.005, ``settings`` on top. ``assets`` is conftest's ``tiny_assets``: (model, task,
    the module's folder). Returns the outcome and the run's folder, ``<folder>/outputs/<name>``
    (which a run refused before it starts never makes)."""
    model, task, base = assets
    home, connection = superlink
    config = {
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "text-fields": "sentence",
        "rank": TINY_RANK,
        "num-server-rounds": 2,
        "min-available-nodes": TINY_NUM_NODES,
        "learning-rate": 0.005,
        "output-dir": str(base / "outputs"),
        "run-name": name,
        "progress-bar": False,
        **settings,
    }
    outcome = run_flower_app(APP, connection, config, home, timeout=600, stream=None)
    return outcome, base / "outputs" / name
