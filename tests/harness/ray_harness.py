"""Test helpers: a private Ray cluster on this machine, started and stopped by pid.

Not a test module (``__test__`` says so).

* ``private_ray_cluster(root, head_cpus, worker_cpus)``: ``ray start --head`` with
  ``head_cpus`` CPUs and, when ``worker_cpus`` is given, a second node that joins it the way
  another machine would (``ray start --address HEAD``). Each node runs ``ray start --block``
  in its own session and is stopped by its pid (``ray stop`` would stop every Ray on the
  machine); on exit nothing either node started may be left alive. Each node also dies
  with the process that started it when that process is killed (pytest ended by a
  timeout's SIGTERM, or SIGKILL): it is started with ``florg_tools.processes.spawn``, as
  the tooling starts its SuperLinks, so ``ray start`` gets a parent-death signal and a
  watchdog stops every Ray process carrying the node's environment tag (GCS, raylet:
  they inherit it) or in its process group (the agents and workers, whose process titles
  hide their environment) once the starter is gone (tests/deployment/test_orphans.py).
* ``two_node_ray_cluster``: a head without CPUs and one joined node
(tests/deployment/test_ray_cluster.py,
  docs/deploy-ray.md's commands).
* ``shared_ray_simulation_superlink``: one single-node cluster (one CPU by default: one
  ClientApp actor a run) and a simulation SuperLink whose runs attach to it (``RAY_ADDRESS``,
  as docs/deploy-ray.md says), so a test module's many simulations do not each start and
  stop a Ray of their own (seconds a run: Ray's start and stop). Flower's default, a Ray
  started by each run, stays covered by the modules that use ``local_simulation_superlink``
  alone (tests/deployment/test_flower_plumbing.py, test_task_kinds.py,
  test_method_registry.py, test_real_model.py, the experiment runner's and the launcher's).

Ray's unix sockets live under the cluster's temp dir, whose path must stay short (107 bytes):
callers pass a root under /tmp, not pytest's deep tmp_path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from florg_tools.flwr_home import RAY_ADDRESS_ENV_VAR
from florg_tools.processes import TrackedProcess, spawn
from florg_tools.superlink import SimulationSuperLink, find_free_port, local_simulation_superlink

__test__ = False  # not a test module

__all__ = [
    "RayCluster",
    "RayNode",
    "private_ray_cluster",
    "shared_ray_simulation_superlink",
    "start_ray_node",
    "two_node_ray_cluster",
]

BIN = Path(sys.executable).parent


@dataclass
class RayNode:
    """``ray start ... --block`` in its own session; SIGTERM to it stops this node only.
    ``tracker`` follows it and every process carrying its tag, and releases its watchdog
    once the node is stopped."""

    name: str
    popen: subprocess.Popen[bytes]
    temp_dir: Path
    log: Path
    tracker: TrackedProcess
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create time

    @property
    def tag(self) -> str | None:
        return self.tracker.tag

    @property
    def sid(self) -> int:
        return self.popen.pid  # start_new_session: the session id is its pid

    def processes(self) -> list[psutil.Process]:
        """Live (non-zombie) processes of this node's session; records what it saw."""
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.sid and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
                    self.seen.setdefault(proc.pid, proc.create_time())
            except (psutil.Error, OSError):
                continue
        return found

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, grace: float = 20.0) -> list[str]:
        """SIGTERM to ``ray start --block`` (it stops its raylet, GCS, ... and exits), then
        SIGKILL to whatever of its session is left; returns the survivors (none, normally)."""
        self.processes()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace)
        deadline = time.monotonic() + 15.0
        while (left := self.processes()) and time.monotonic() < deadline:
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            time.sleep(0.5)
        if self.popen.poll() is None:
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        survivors = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in self.processes()]
        # Whatever carries the node's tag outside its session (nothing, normally); then
        # the watchdog is released: the node is stopped, nothing is left to guard.
        left = self.tracker.stop(grace=1.0)
        return survivors + [f"{p.pid}: {p.cmdline[:120]}" for p in left]


def start_ray_node(
    name: str, args: list[str], temp_dir: Path, env: dict[str, str], timeout: float = 150.0
) -> RayNode:
    """``ray start ARGS --temp-dir DIR --block``; ready when Ray has written
    ``DIR/ray_current_cluster`` (the GCS address), which it does once the node is up.
    Started by ``spawn``: its own session, and it dies with this process (module
    docstring)."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = temp_dir.parent / f"{name}.log"
    command = [str(BIN / "ray"), "start", *args, "--temp-dir", str(temp_dir), "--block"]
    popen, tag = spawn(command, env=env, log_path=log)
    node = RayNode(name, popen, temp_dir, log, TrackedProcess(popen, tag, log))
    deadline = time.monotonic() + timeout
    while not (temp_dir / "ray_current_cluster").exists():
        if popen.poll() is not None or time.monotonic() > deadline:
            node.stop()
            raise AssertionError(f"`{' '.join(command)}` did not start:\n{node.log_tail()}")
        time.sleep(0.5)
    node.processes()
    return node


@dataclass
class RayCluster:
    root: Path
    address: str  # the head's GCS address, as `ray start --head` reports it
    env: dict[str, str]
    nodes: list[RayNode]


@contextlib.contextmanager
def private_ray_cluster(
    root: Path,
    head_cpus: int,
    worker_cpus: int | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[RayCluster]:
    """A head with ``head_cpus`` CPUs and, if ``worker_cpus`` is given, one node that joins
    it with ``ray start --address``; both stopped by pid on exit, and checked to be gone.
    ``extra_env`` goes to the nodes and so to every worker they start (Ray's workers
    inherit the raylet's environment, not the driver's)."""
    # No idle Python workers started ahead of time: the ClientApp actors need workers with
    # the runtime env flwr-simulation asks for, so prestarted ones would only cost CPU.
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_enable_worker_prestart": "0",
        "RAY_prestart_worker_first_driver": "0",
        **(extra_env or {}),
    }
    env.pop(RAY_ADDRESS_ENV_VAR, None)
    nodes: list[RayNode] = []
    failed = True
    try:
        # The ports Ray would otherwise take by default (6379, 8265, 10001, 52365) may
        # be in use by other Ray instances on this machine.
        head = start_ray_node(
            "head",
            ["--head", "--port", str(find_free_port("0.0.0.0")),
             "--node-ip-address", "127.0.0.1", "--num-cpus", str(head_cpus), "--num-gpus", "0",
             "--include-dashboard=false", "--dashboard-port", str(find_free_port()),
             "--ray-client-server-port", str(find_free_port("0.0.0.0")),
             "--dashboard-agent-listen-port", str(find_free_port("0.0.0.0")),
             "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"],
            root / "head",
            env,
        )  # fmt: skip
        nodes.append(head)
        address = (root / "head" / "ray_current_cluster").read_text().strip()
        if worker_cpus is not None:
            worker = start_ray_node(
                "worker",
                ["--address", address, "--num-cpus", str(worker_cpus), "--num-gpus", "0",
                 "--dashboard-agent-listen-port", str(find_free_port("0.0.0.0")),
                 "--object-store-memory", str(100 * 2**20)],
                root / "worker",
                env,
            )  # fmt: skip
            nodes.append(worker)
        yield RayCluster(root, address, env, nodes)
        failed = False
    finally:
        survivors = [s for node in reversed(nodes) for s in node.stop()]
        leaked = []
        for node in nodes:
            for pid, created in node.seen.items():
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                        leaked.append(f"{pid}: {' '.join(proc.cmdline())[:120]}")
        if (survivors or leaked) and not failed:
            lines = "\n".join(survivors + leaked)
            raise AssertionError(f"Ray processes survived the stop:\n{lines}")


@contextlib.contextmanager
def two_node_ray_cluster(root: Path, worker_cpus: int = 2) -> Iterator[RayCluster]:
    """A head without CPUs (it schedules nothing) and one node with ``worker_cpus``."""
    with private_ray_cluster(root, head_cpus=0, worker_cpus=worker_cpus) as cluster:
        yield cluster


@contextlib.contextmanager
def shared_ray_simulation_superlink(
    tmp_dir: Path,
    num_supernodes: int,
    extra_env: Mapping[str, str] | None = None,
    actors: int = 1,
) -> Iterator[SimulationSuperLink]:
    """``local_simulation_superlink(tmp_dir, num_supernodes, extra_env=...)`` whose runs
    attach to one private single-node Ray cluster; ``extra_env`` reaches the ClientApp
    actors through the cluster's nodes, as it reaches them through the SuperLink when each
    run starts its own Ray. The SuperLink stops first, then the cluster, each checked for
    survivors.

    The cluster has ``actors`` CPUs, one per client: each run gets that many ClientApp
    actors, which serve its sampled nodes in turn (as Flower's actors do whenever a
    federation has more nodes than actors). One by default, not one per CPU as a run's own
    Ray would have: each actor's start imports torch, transformers and datasets, seconds of
    CPU that on CI's two cores cost more than the tiny models' parallel training saves."""
    root = Path(tempfile.mkdtemp(prefix="rays-", dir="/tmp"))
    try:
        with contextlib.ExitStack() as stack:
            cluster = stack.enter_context(
                private_ray_cluster(root, head_cpus=actors, extra_env=extra_env)
            )
            yield stack.enter_context(
                local_simulation_superlink(
                    tmp_dir,
                    num_supernodes,
                    extra_env={**(extra_env or {}), RAY_ADDRESS_ENV_VAR: cluster.address},
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
