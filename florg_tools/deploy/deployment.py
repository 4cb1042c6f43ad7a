"""Start a SuperLink, N SuperNodes (and SuperExecs) on free ports, wait until they are ready,
and stop every process again by pid.

Each process is started from the argv of ``florg_tools.deploy.commands`` in its own session,
with its own environment tag, and tracked with ``florg_tools.processes.TrackedProcess``
(itself, its descendants, and every process carrying its tag, even after they re-parent),
so stopping a SuperNode also stops its SuperExec and ClientApp processes. Nothing is ever
killed by name. ``Deployment`` is a context manager: leaving it -- also through an
exception -- stops everything and reports any survivor.

SuperNodes can run inside a network namespace (``netns``: ``ip netns exec NS`` prefixes
the argv; ``ip`` execs the command, so the pid stays the same).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from florg_tools.deploy.certs import CertificateSet, NodeKey, require_files
from florg_tools.deploy.commands import (
    DeployConfigError,
    deployment_env,
    local_runtime_address,
    split_address,
    superexec_argv,
    superlink_argv,
    supernode_argv,
)
from florg_tools.flwr_cli import (
    LaunchError,
    console_script,
    flwr_env,
    parse_cli_json,
    run_flwr,
    strip_ansi,
)
from florg_tools.flwr_home import write_tls_connection
from florg_tools.processes import ProcInfo, TrackedProcess, spawn
from florg_tools.superlink import find_free_port
from florg_tools.superlink import wait_healthy as _wait_for_health

__all__ = [
    "Deployment",
    "ManagedProcess",
    "register_node",
    "start_process",
    "thread_env",
    "wait_for_log",
    "wait_healthy",
]

_NODE_ID_RE = re.compile(r"SuperNode ID: (\d+)")
PORT_TAKEN = "address already in use"  # uvicorn's bind error (errno 98) in a SuperNode's log
PORT_ATTEMPTS = 3


def thread_env(threads: int) -> dict[str, str]:
    """Thread caps for a process sharing the machine (what Ray gives a simulated client:
    ``OMP_NUM_THREADS`` = its CPUs); without them several SuperNodes' BLAS thread pools
    oversubscribe the cores and spin."""
    if threads < 1:
        raise DeployConfigError(f"threads per node must be >= 1, got {threads}")
    value = str(int(threads))
    return {"OMP_NUM_THREADS": value, "OPENBLAS_NUM_THREADS": value, "MKL_NUM_THREADS": value}


def register_node(flwr_home: Path, connection: str, public_key: Path, timeout: float = 60.0) -> int:
    """``flwr supernode register PUBLIC_KEY CONNECTION``: admit a SuperNode's key to a
    SuperLink started with ``--enable-supernode-auth``; returns the node id."""
    require_files(public_key, what="SuperNode public key")
    proc = run_flwr(
        ["supernode", "register", str(public_key), connection, "--format", "json"],
        flwr_env(flwr_home, extra=deployment_env()),
        timeout,
    )
    payload = parse_cli_json(proc.stdout)
    if not payload or not payload.get("success") or payload.get("node-id") is None:
        error = (payload or {}).get("error-message") or (proc.stdout + proc.stderr)
        raise LaunchError(f"`flwr supernode register {public_key}` failed: {strip_ansi(error)}")
    return int(payload["node-id"])


@dataclass
class ManagedProcess:
    """One started process (``tracker`` follows it and everything it spawns)."""

    name: str
    argv: list[str]
    tracker: TrackedProcess
    log_path: Path
    netns: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.tracker.pid

    def alive(self) -> bool:
        return self.tracker.popen.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, grace: float = 5.0) -> list[ProcInfo]:
        """SIGTERM, then SIGKILL, to it and its whole tree; the survivors (none on success)."""
        return self.tracker.stop(grace=grace)

    def kill(self) -> list[ProcInfo]:
        """SIGKILL (a crash: no goodbye to the SuperLink), then clean up its tree."""
        self.tracker.scan()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.tracker.popen.wait(timeout=10.0)
        return self.tracker.stop(grace=0.5)


def start_process(
    argv: Sequence[str],
    *,
    name: str,
    log_path: Path,
    flwr_home: Path,
    cwd: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    netns: str | None = None,
) -> ManagedProcess:
    """Start ``argv`` (its first item resolved in this venv's ``bin``) in a new session,
    logging to ``log_path``, with the deployment environment and a fresh tag."""
    if not argv:
        raise DeployConfigError(f"{name}: empty command")
    command = [*console_script(argv[0]), *argv[1:]]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    env = flwr_env(flwr_home, extra={**deployment_env(), **(extra_env or {})})
    popen, tag = spawn(command, env=env, log_path=log_path, cwd=cwd, header=True)
    tracker = TrackedProcess(popen, tag, log_path)
    tracker.start_tracking()
    return ManagedProcess(name, list(argv), tracker, log_path, netns)


def wait_healthy(
    process: ManagedProcess,
    address: str,
    *,
    ca_cert: Path | None,
    timeout: float = 60.0,
) -> None:
    """Poll ``GET /health`` on ``address`` (HTTPS verified with ``ca_cert``, or HTTP)."""
    host, port = split_address(address)
    scheme = "https" if ca_cert is not None else "http"
    try:
        _wait_for_health(
            f"{scheme}://{host}:{port}/health",
            exit_code=process.tracker.popen.poll,
            timeout=timeout,
            ca_cert=ca_cert,
            name=process.name,
        )
    except LaunchError as err:
        raise LaunchError(f"{err}:\n" + process.log_text()[-3000:]) from None


def wait_for_log(process: ManagedProcess, pattern: re.Pattern[str], timeout: float) -> str:
    """The first match of ``pattern`` in the process's log (group 1 if any)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(process.log_text())
        if match:
            return match.group(1) if match.groups() else match.group(0)
        if not process.alive():
            break
        time.sleep(0.25)
    state = "exited" if not process.alive() else f"no {pattern.pattern!r} after {timeout:.0f}s"
    raise LaunchError(f"{process.name} {state}:\n" + process.log_text()[-3000:])


@dataclass
class Deployment:
    """A SuperLink and its SuperNodes on this machine (for demos, tests and benchmarks).

    ``certs=None`` runs without TLS, allowed only on loopback (``commands`` refuses
    otherwise). ``bind_host`` is where the SuperLink listens, ``dial_host`` how the CLI
    reaches it (default: loopback for ``0.0.0.0``). ``node_hosts[i]`` is the address node
    ``i`` dials (for nodes in network namespaces, the host side of their veth).
    """

    directory: Path
    certs: CertificateSet | None = None
    bind_host: str = "127.0.0.1"
    port: int | None = None
    isolation: str = "subprocess"
    node_auth: bool = False
    connection: str = "deployment"
    cwd: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    database: Path | None = None  # the SuperLink's state in SQLite (survives a restart)
    superlink: ManagedProcess | None = None
    supernodes: dict[int, ManagedProcess] = field(default_factory=dict)
    superexecs: list[ManagedProcess] = field(default_factory=list)
    retired: list[ManagedProcess] = field(default_factory=list)
    _node_ports: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.flwr_home = self.directory / "flwr_home"
        self.logs = self.directory / "logs"
        if self.certs is not None:
            tls = self.certs.server_tls()
            require_files(tls.ca_certfile, tls.certfile, tls.keyfile)

    # -- addresses ---------------------------------------------------------------------
    @property
    def address(self) -> str:
        """How processes on this machine (CLI, local SuperNodes) reach the SuperLink."""
        if self.port is None:
            raise LaunchError("the SuperLink is not started")
        return local_runtime_address(self.bind_host, self.port)

    @property
    def ca_cert(self) -> Path | None:
        return self.certs.ca_cert if self.certs is not None else None

    # -- starting ------------------------------------------------------------------------
    def start_superlink(self, startup_timeout: float = 60.0, attempts: int = 3) -> ManagedProcess:
        """Start the SuperLink (on a free port unless ``port`` was given), write the
        ``connection`` into ``<directory>/flwr_home/config.toml``, and (with
        ``isolation="process"``) its SuperExec; wait until it answers ``/health``."""
        last: Exception | None = None
        fixed = self.port is not None
        for _ in range(attempts if not fixed else 1):
            port = self.port if fixed else find_free_port(self.bind_host)
            assert port is not None
            argv = superlink_argv(
                host=self.bind_host,
                port=port,
                tls=self.certs.server_tls() if self.certs else None,
                insecure=self.certs is None,
                isolation=self.isolation,
                enable_supernode_auth=self.node_auth,
                database=self.database,
            )
            process = start_process(
                argv,
                name="superlink",
                log_path=self.logs / "superlink.log",
                flwr_home=self.flwr_home,
                cwd=self.cwd or self.directory,
                extra_env=self.extra_env,
            )
            self.port = port
            try:
                wait_healthy(process, self.address, ca_cert=self.ca_cert, timeout=startup_timeout)
            except LaunchError as err:
                process.stop(grace=2.0)
                self.retired.append(process)
                last = err
                if not fixed:
                    self.port = None
                continue
            self.superlink = process
            break
        if self.superlink is None:
            raise LaunchError(f"could not start the SuperLink: {last}")
        write_tls_connection(
            self.flwr_home,
            self.connection,
            self.address,
            root_certificates=self.ca_cert,
            insecure=self.certs is None,
            set_default=True,
        )
        if self.isolation == "process":
            self.superexecs.append(
                self._start_superexec("superexec-serverapp", self.address, self.ca_cert, None)
            )
        return self.superlink

    def _start_superexec(
        self, name: str, runtime: str, ca: Path | None, netns: str | None
    ) -> ManagedProcess:
        argv = superexec_argv(runtime, root_certificates=ca, insecure=ca is None)
        return start_process(
            argv,
            name=name,
            log_path=self.logs / f"{name}.log",
            flwr_home=self.flwr_home,
            cwd=self.cwd or self.directory,
            extra_env=self.extra_env,
            netns=netns,
        )

    def start_supernode(
        self,
        partition_id: int,
        num_partitions: int,
        *,
        superlink_host: str | None = None,
        superlink_port: int | None = None,
        data_path: str | Path | None = None,
        rank: int | None = None,
        netns: str | None = None,
        auth_key: NodeKey | None = None,
        env: Mapping[str, str] | None = None,
        node_config: Mapping[str, str | int | float | bool] | None = None,
        wait: bool = True,
        timeout: float = 90.0,
    ) -> ManagedProcess:
        """Start the SuperNode for ``partition_id`` (replacing a stopped one).

        ``superlink_host`` is the address it dials (default: ``address``'s host),
        ``superlink_port`` the port (default: the SuperLink's; another for a proxy);
        ``rank``: the node's adapter rank (node-config ``rank``; issue 30).
        ``netns`` runs it (and its SuperExec and ClientApps) in that network namespace.
        ``node_config``: further node-config keys (``slowdown``, a straggler).
        With ``wait``, returns once it has registered (its log names its node id, stored
        in ``info["node-id"]``).
        """
        if self.superlink is None or self.port is None:
            raise LaunchError("start the SuperLink first")
        old = self.supernodes.get(partition_id)
        if old is not None and old.alive():
            raise LaunchError(f"SuperNode for partition {partition_id} is already running")
        host = superlink_host or split_address(self.address)[0]
        superlink = f"{host}:{superlink_port or self.port}"
        # Each SuperNode's own Runtime API port; in its own netns the default is free.
        runtime_port = None
        fresh_port = netns is None and partition_id not in self._node_ports
        if netns is None:
            runtime_port = self._node_ports.get(partition_id) or find_free_port("127.0.0.1")
            self._node_ports[partition_id] = runtime_port
        isolation = self.isolation
        argv = supernode_argv(
            superlink,
            partition_id=partition_id,
            num_partitions=num_partitions,
            data_path=data_path,
            rank=rank,
            root_certificates=self.ca_cert,
            insecure=self.ca_cert is None,
            isolation=isolation,
            runtime_port=runtime_port,
            auth_private_key=auth_key.private_key if auth_key else None,
            node_config=node_config,
        )
        name = f"supernode-{partition_id}"
        home = self.directory / "nodes" / name
        restarts = sum(p.name == name for p in self.retired) + (old is not None)
        process = start_process(
            argv,
            name=name,
            log_path=self.logs / (f"{name}.log" if not restarts else f"{name}.{restarts}.log"),
            flwr_home=home,
            cwd=self.cwd or self.directory,
            extra_env={**self.extra_env, **(env or {})},
            netns=netns,
        )
        process.info["partition-id"] = partition_id
        # how to start it again on another port, should the one found free be taken first
        process.info["restart"] = dict(
            partition_id=partition_id, num_partitions=num_partitions,
            superlink_host=superlink_host, superlink_port=superlink_port, data_path=data_path,
            rank=rank, netns=netns, auth_key=auth_key, env=env, node_config=node_config,
        ) if fresh_port else None  # fmt: skip
        if old is not None:
            self.retired.append(old)
        self.supernodes[partition_id] = process
        if isolation == "process":
            runtime = f"127.0.0.1:{runtime_port or 9094}"
            self.superexecs.append(
                self._start_superexec(f"superexec-clientapp-{partition_id}", runtime, None, netns)
            )
        if wait:
            process = self._registered(process, timeout)
        return process

    def _registered(self, process: ManagedProcess, timeout: float) -> ManagedProcess:
        """``process`` once it has registered (its node id in ``info["node-id"]``). A
        SuperNode whose Runtime API port, found free, was taken by another process before it
        bound it (``address already in use``: the race of any free-port search) is started
        again on a new port, up to ``PORT_ATTEMPTS`` times; any other failure is raised."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                process.info["node-id"] = int(wait_for_log(process, _NODE_ID_RE, timeout))
                return process
            except LaunchError:
                again = process.info.get("restart")
                lost_port = not process.alive() and PORT_TAKEN in process.log_text()
                if again is None or not lost_port or attempt + 1 == PORT_ATTEMPTS:
                    raise
            self._node_ports.pop(again["partition_id"], None)
            process = self.start_supernode(**again, wait=False)
        raise AssertionError("unreachable")

    def wait_registered(self, timeout: float = 90.0) -> dict[int, int]:
        """Wait until every running SuperNode has registered; {partition id: node id}."""
        for proc in list(self.supernodes.values()):
            # a SuperNode that exited for a taken port is started again; others as they were
            if "node-id" not in proc.info and (proc.alive() or PORT_TAKEN in proc.log_text()):
                self._registered(proc, timeout)
        return {pid: p.info["node-id"] for pid, p in self.supernodes.items() if p.alive()}

    def node_ids(self) -> dict[int, int]:
        """{node id: partition id} of every SuperNode started (also stopped ones)."""
        mapping: dict[int, int] = {}
        for proc in [*self.retired, *self.supernodes.values()]:
            node_id = proc.info.get("node-id")
            if node_id is None:
                match = _NODE_ID_RE.search(proc.log_text())
                node_id = int(match.group(1)) if match else None
            if node_id is not None and "partition-id" in proc.info:
                mapping[int(node_id)] = int(proc.info["partition-id"])
        return mapping

    # -- stopping ------------------------------------------------------------------------
    def processes(self) -> list[ManagedProcess]:
        nodes = list(self.supernodes.values())
        main = [self.superlink] if self.superlink is not None else []
        return [*self.superexecs, *nodes, *main, *self.retired]

    def recorded(self) -> list[ProcInfo]:
        """Every process seen under any of ours (also the ones that have exited)."""
        return [info for proc in self.processes() for info in proc.tracker.recorded()]

    def tags(self) -> list[str]:
        return [proc.tracker.tag for proc in self.processes()]

    def stop(self) -> list[ProcInfo]:
        """Stop SuperExecs, SuperNodes, then the SuperLink, each with its whole tree, by
        pid; return the survivors (empty on success)."""
        survivors: list[ProcInfo] = []
        for proc in self.processes():
            survivors += proc.stop()
        return survivors

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        leftovers = self.stop()
        if leftovers:
            print(
                "[deploy] warning: processes survived the shutdown: "
                + ", ".join(f"{p.pid} ({p.cmdline[:60]})" for p in leftovers),
                file=sys.stderr,
            )
