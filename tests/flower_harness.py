"""Test helpers: a private simulation SuperLink per test, and leak checks.

Not a test module (pytest collects only ``test_*.py``; ``__test__`` says so too).

``local_simulation_superlink`` starts ``flower-superlink --simulation`` on a free port with
its own ``FLWR_HOME`` (so concurrent tests never share ports, state or installed apps),
writes a connection pointing at it, and on exit -- also when the test failed -- stops it
and every process it spawned (SuperExec, ``flwr-simulation``, the Ray cluster), then checks
with psutil (or ``/proc`` when psutil is missing) that none of the processes it recorded
while the SuperLink was up is still alive.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florg_tools.flwr_home import write_local_simulation_connection
from florg_tools.launch import (
    TAG_ENV_VAR,
    ProcInfo,
    RunOutcome,
    SuperLinkProcess,
    run_flower_app,
    start_local_superlink,
)
from flower_app.paths import OUTPUT_ROOT_ENV

__test__ = False  # not a test module

__all__ = [
    "HARNESS_CONNECTION",
    "LeakedProcessesError",
    "SimulationSuperLink",
    "live_processes",
    "local_simulation_superlink",
    "run_app_in_simulation",
]

HARNESS_CONNECTION = "harness-simulation"


class LeakedProcessesError(AssertionError):
    """Processes spawned for a test outlived its SuperLink."""


@dataclass(frozen=True)
class SimulationSuperLink:
    """Unpacks as ``(flwr_home, connection_name)``; ``superlink`` has the process data."""

    flwr_home: Path
    connection: str
    superlink: SuperLinkProcess

    def __iter__(self) -> Iterator[Any]:
        return iter((self.flwr_home, self.connection))


def live_processes(recorded: list[ProcInfo], tag: str | None = None) -> list[str]:
    """Descriptions of the ``recorded`` processes still alive (same pid and start time,
    not a zombie), plus any process carrying the SuperLink ``tag``; psutil if installed,
    else ``/proc``."""
    try:
        import psutil
    except ImportError:
        psutil = None  # type: ignore[assignment]
    alive: dict[int, str] = {}
    if psutil is not None:
        for info in recorded:
            try:
                proc = psutil.Process(info.pid)
                if (
                    abs(proc.create_time() - info.start_time) < 1.0
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    alive[info.pid] = info.cmdline
            except psutil.Error:
                continue
        if tag:
            for proc in psutil.process_iter():
                try:
                    if (
                        proc.pid != os.getpid()
                        and proc.environ().get(TAG_ENV_VAR) == tag
                        and proc.status() != psutil.STATUS_ZOMBIE
                    ):
                        alive[proc.pid] = " ".join(proc.cmdline())
                except psutil.Error:
                    continue
    else:
        from florg_tools.launch import _process_table

        table = _process_table(tag)
        for info in recorded:
            now = table.get(info.pid)
            if now is not None and abs(now.start_time - info.start_time) < 1.0 and not now.zombie:
                alive[info.pid] = info.cmdline
        for now in table.values():
            if now.tagged and not now.zombie and now.pid != os.getpid():
                alive[now.pid] = now.cmdline
    return [f"{pid}: {cmd[:160]}" for pid, cmd in sorted(alive.items())]


@contextlib.contextmanager
def local_simulation_superlink(
    tmp_dir: Path,
    num_supernodes: int = 2,
    *,
    num_cpus_per_client: int = 1,
    num_gpus_per_client: float = 0.0,
    connection_name: str = HARNESS_CONNECTION,
    startup_timeout: float = 60.0,
    cwd: Path | None = None,
    output_root: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[SimulationSuperLink]:
    """A private simulation SuperLink; yields ``(flwr_home, connection_name)``.

    ``<tmp_dir>/flwr_home`` becomes the SuperLink's and the CLI's ``FLWR_HOME`` (the FAB is
    installed under ``apps/`` there); the ServerApp runs with ``cwd`` (default ``tmp_dir``)
    as its working directory; the SuperLink log is ``<tmp_dir>/superlink.log``. The
    ServerApp's output root (``$FLORG_OUTPUT_ROOT``, flower_app/paths.py) is ``output_root``,
    by default the parent of ``tmp_dir`` (the test's own temporary folder); ``extra_env``
    goes to the SuperLink and everything it starts.
    """
    tmp_dir = Path(tmp_dir)
    flwr_home = tmp_dir / "flwr_home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    superlink = start_local_superlink(
        flwr_home,
        log_path=tmp_dir / "superlink.log",
        cwd=cwd or tmp_dir,
        startup_timeout=startup_timeout,
        extra_env={
            "FLWR_TELEMETRY_ENABLED": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            OUTPUT_ROOT_ENV: str(Path(output_root or tmp_dir.parent).resolve()),
            **(extra_env or {}),
        },
    )
    failed = True
    try:
        write_local_simulation_connection(
            flwr_home,
            connection_name,
            num_supernodes=num_supernodes,
            num_cpus_per_client=num_cpus_per_client,
            num_gpus_per_client=num_gpus_per_client,
            address=superlink.address,
            set_default=True,
        )
        yield SimulationSuperLink(flwr_home, connection_name, superlink)
        failed = False
    finally:
        superlink.stop()
        leaked = live_processes(superlink.recorded(), superlink.tag)
        if leaked:
            message = "processes survived the SuperLink shutdown:\n" + "\n".join(leaked)
            if failed:
                warnings.warn(message, RuntimeWarning, stacklevel=2)  # keep the real error
            else:
                raise LeakedProcessesError(message)


def run_app_in_simulation(
    app_dir: Path,
    run_config: Mapping[str, Any] | None = None,
    num_supernodes: int = 2,
    tmp_dir: Path | None = None,
    timeout: float = 300.0,
    **run_kwargs: Any,
) -> RunOutcome:
    """Run a Flower App through the real simulation engine on a private SuperLink.

    ``run_kwargs`` go to ``florg_tools.launch.run_flower_app`` (``validate``, ``stream``,
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
