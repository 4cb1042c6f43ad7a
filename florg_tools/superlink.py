"""A private local SuperLink: ``flower-superlink --simulation`` on a free port, stopped
together with every process it spawned (SuperExec, ``flwr-simulation``, the Ray cluster).

All of those inherit a unique environment tag (``florg_tools.processes.TAG_ENV_VAR``) and
are stopped by pid, never by name; none outlives the process that started the SuperLink,
even one killed with SIGTERM or SIGKILL (``florg_tools.processes.spawn``;
tests/deployment/test_orphans.py).

* ``start_local_superlink`` / ``local_superlink``: the SuperLink alone (the caller writes a
  connection to ``SuperLinkProcess.address``);
* ``local_simulation_superlink``: with its own ``FLWR_HOME`` and a simulation connection
  to it, checked on exit for processes that outlived it (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florg_tools.flwr_cli import LaunchError, console_script, flwr_env
from florg_tools.flwr_home import write_local_simulation_connection
from florg_tools.processes import LeakedProcessesError, TrackedProcess, spawn, still_alive

__all__ = [
    "SIMULATION_CONNECTION",
    "SimulationSuperLink",
    "SuperLinkProcess",
    "find_free_port",
    "local_simulation_superlink",
    "local_superlink",
    "start_local_superlink",
    "wait_healthy",
]

SIMULATION_CONNECTION = "private-simulation"


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, then release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_healthy(
    url: str,
    *,
    exit_code: Callable[[], int | None],
    timeout: float = 60.0,
    ca_cert: Path | None = None,
    name: str = "flower-superlink",
) -> None:
    """Poll ``GET url`` (a ``/health`` endpoint; HTTPS verified with ``ca_cert``) until it
    answers 2xx; ``LaunchError`` if the process exits first (``exit_code()`` is not None)
    or ``timeout`` passes."""
    context = ssl.create_default_context(cafile=str(ca_cert)) if ca_cert is not None else None
    deadline = time.monotonic() + timeout
    error: Exception | None = None
    while time.monotonic() < deadline:
        code = exit_code()
        if code is not None:
            raise LaunchError(f"{name} exited with code {code}")
        try:
            with urllib.request.urlopen(url, timeout=2.0, context=context) as response:
                if 200 <= response.status < 300:
                    return
        except (urllib.error.URLError, OSError) as err:
            error = err
        time.sleep(0.25)
    raise LaunchError(f"{name} was not healthy at {url} after {timeout:.0f}s ({error})")


class SuperLinkProcess(TrackedProcess):
    """A ``flower-superlink --simulation`` started by us, and everything it spawned."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        host: str,
        port: int,
        tag: str,
        flwr_home: Path,
        log_path: Path,
    ) -> None:
        super().__init__(popen, tag, log_path)
        self.host = host
        self.port = port
        self.flwr_home = flwr_home

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def start_local_superlink(
    flwr_home: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: Path | None = None,
    cwd: Path | None = None,
    startup_timeout: float = 60.0,
    extra_env: Mapping[str, str] | None = None,
    attempts: int = 3,
) -> SuperLinkProcess:
    """Start ``flower-superlink --insecure --simulation`` on a free port.

    One HTTP port (``--host``/``--port``) serves the Control, Fleet and
    Runtime (ServerAppIo) APIs; ``--control-api-address``/``--fleet-api-address`` are
    deprecated no-ops. The SuperLink runs in its own session; it spawns
    ``flower-superexec`` (another session), which spawns ``flwr-simulation`` and Ray.
    ``cwd`` becomes the ServerApp's working directory; state is in memory. Stop it with
    ``SuperLinkProcess.stop()`` (or use ``local_superlink``).
    """
    flwr_home = Path(flwr_home).expanduser().resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path else flwr_home / "superlink.log"
    last_error: Exception | None = None
    for _ in range(max(1, attempts)):
        chosen = port if port is not None else find_free_port(host)
        command = [
            *console_script("flower-superlink"),
            "--insecure",
            "--simulation",
            "--host",
            host,
            "--port",
            str(chosen),
            "--disable-runtime-dependency-installation",
        ]
        env = flwr_env(flwr_home, extra=extra_env)
        popen, tag = spawn(command, env=env, log_path=log_path, cwd=cwd)
        superlink = SuperLinkProcess(popen, host, chosen, tag, flwr_home, log_path)
        superlink.start_tracking()
        try:
            wait_healthy(
                f"http://{host}:{chosen}/health", exit_code=popen.poll, timeout=startup_timeout
            )
        except (LaunchError, KeyboardInterrupt) as err:
            superlink.stop(grace=2.0)
            if isinstance(err, KeyboardInterrupt):
                raise
            last_error = err
            if port is not None:
                break
            continue
        return superlink
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
    raise LaunchError(f"could not start flower-superlink: {last_error}\n{tail}")


@contextlib.contextmanager
def local_superlink(flwr_home: Path, **kwargs: Any) -> Iterator[SuperLinkProcess]:
    """``start_local_superlink`` as a context manager that always stops it again. Ray's
    session folders (logs, sockets: megabytes a run) go to a temporary folder of its own
    (``RAY_TMPDIR``; a short path, as Ray's Unix sockets need), removed afterwards, unless
    the simulation joins a Ray cluster (``RAY_ADDRESS``), whose folders are the cluster's."""
    extra_env = dict(kwargs.pop("extra_env", None) or {})
    ray_tmp = None
    if "RAY_ADDRESS" not in extra_env and "RAY_ADDRESS" not in os.environ:
        ray_tmp = tempfile.mkdtemp(prefix="florg-ray-")
        extra_env.setdefault("RAY_TMPDIR", ray_tmp)
    try:
        superlink = start_local_superlink(flwr_home, extra_env=extra_env, **kwargs)
    except BaseException:
        if ray_tmp is not None:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        raise
    try:
        yield superlink
    finally:
        leftovers = superlink.stop()
        if ray_tmp is not None:
            shutil.rmtree(ray_tmp, ignore_errors=True)
        if leftovers:
            print(
                "[launch] warning: processes survived the SuperLink shutdown: "
                + ", ".join(f"{p.pid} ({p.cmdline[:60]})" for p in leftovers),
                file=sys.stderr,
            )


@dataclass(frozen=True)
class SimulationSuperLink:
    """Unpacks as ``(flwr_home, connection_name)``; ``superlink`` has the process data."""

    flwr_home: Path
    connection: str
    superlink: SuperLinkProcess

    def __iter__(self) -> Iterator[Any]:
        return iter((self.flwr_home, self.connection))


@contextlib.contextmanager
def local_simulation_superlink(
    tmp_dir: Path,
    num_supernodes: int = 2,
    *,
    num_cpus_per_client: int = 1,
    num_gpus_per_client: float = 0.0,
    connection_name: str = SIMULATION_CONNECTION,
    startup_timeout: float = 60.0,
    cwd: Path | None = None,
    output_root: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[SimulationSuperLink]:
    """A private simulation SuperLink; yields ``(flwr_home, connection_name)``.

    ``<tmp_dir>/flwr_home`` becomes the SuperLink's and the CLI's ``FLWR_HOME`` (so
    concurrent users never share ports, state or installed apps; the FAB is installed under
    ``apps/`` there) and holds the connection ``connection_name`` (the default one) to the
    SuperLink, with ``num_supernodes`` simulated nodes. The ServerApp runs with ``cwd``
    (default ``tmp_dir``) as its working directory; the SuperLink log is
    ``<tmp_dir>/superlink.log``. The ServerApp's output root (``$FLORG_OUTPUT_ROOT``,
    flower_app/paths.py) is ``output_root``, by default the parent of ``tmp_dir``;
    ``extra_env`` goes to the SuperLink and everything it starts.

    On exit -- also after an error -- the SuperLink and every process it spawned are
    stopped; if any of the processes recorded while it was up is still alive,
    ``LeakedProcessesError`` is raised (only a warning when the body raised, to keep the
    real error).
    """
    from flower_app.paths import OUTPUT_ROOT_ENV

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
        leaked = still_alive(superlink.recorded(), superlink.tag)
        if leaked:
            message = "processes survived the SuperLink shutdown:\n" + "\n".join(
                f"{p.pid}: {p.cmdline[:160]}" for p in leaked
            )
            if failed:
                warnings.warn(message, RuntimeWarning, stacklevel=2)  # keep the real error
            else:
                raise LeakedProcessesError(message)
