"""The private engine itself: :class:`PrivateDockerd` (``dockerd`` in its own network
namespace, stopped by pid), :func:`start_engine` (storage driver fallback) and
:func:`cached_data_root` (the stable, locked data-root).

The engine dies with the process that started it, also when that process is killed from
outside (a test run ended by ``timeout``'s SIGTERM, or SIGKILL): ``dockerd`` is started
with ``florg_tools.processes.spawn``, as the tooling starts its SuperLinks, which gives it a
parent-death signal and a watchdog that stops it, its ``containerd`` and everything else
carrying its environment tag once the starter is gone (tests/deployment/test_orphans.py). Only the
command line's ``start``, which leaves the engine running for a later ``stop``, opts out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ci.docker_engine.client import (
    DockerClient,
    DockerEngineError,
    cache_root,
    docker_cli,
)
from ci.docker_engine.pids import (
    alive,
    proc_stat,
    remove_tree,
    send_signal,
    snapshot,
    unmount_under,
)
from florg_tools.processes import TrackedProcess, spawn

STORAGE_DRIVERS = ("overlay2", "vfs")


@contextlib.contextmanager
def cached_data_root(*, fresh: bool = False) -> Iterator[tuple[Path, bool]]:
    """``(base, cached)``: the stable ``<cache>/engine`` (one data-root per storage driver
    below it) under an exclusive lock, or -- when another run holds the lock -- a private
    temporary one (``cached`` False), removed afterwards. ``fresh`` wipes the cached one
    first."""
    base = cache_root()
    base.mkdir(parents=True, exist_ok=True)
    with (base / "engine.lock").open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            tmp = Path(tempfile.mkdtemp(prefix="engine-", dir=base))
            try:
                yield tmp, False
            finally:
                remove_tree(tmp)
            return
        root = base / "engine"
        if fresh:
            remove_tree(root)
        yield root, True


@dataclass
class PrivateDockerd:
    """``dockerd`` in its own network namespace (only ``lo``), with everything of its own
    under ``state_dir`` (socket, exec-root, pidfile, config, log, client config) and
    images in ``data_root``. Use as a context manager or call :meth:`start` /
    :meth:`stop`; :meth:`stop` (also after a failure) stops every process by pid.

    ``die_with_starter`` (the default): the engine never outlives the process that started
    it (module docstring); ``tag`` is then the environment tag its processes carry."""

    state_dir: Path
    data_root: Path
    storage_driver: str = "overlay2"
    start_timeout: float = 120.0
    die_with_starter: bool = True
    pid: int | None = None
    tag: str | None = None
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tracked: TrackedProcess | None = field(default=None, repr=False)
    _cli: str | None = field(default=None, repr=False)
    survivors: list[str] = field(default_factory=list)

    # -- paths
    @property
    def socket(self) -> Path:
        return self.state_dir / "docker.sock"

    @property
    def exec_root(self) -> Path:
        return self.state_dir / "exec"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "dockerd.log"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    # -- lifecycle
    def argv(self) -> list[str]:
        return [
            "dockerd",
            f"--storage-driver={self.storage_driver}",
            f"--data-root={self.data_root}",
            f"--exec-root={self.exec_root}",
            f"--pidfile={self.state_dir / 'docker.pid'}",
            f"--host={self.host}",
            f"--config-file={self.state_dir / 'daemon.json'}",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
            "--ip-forward=false",
        ]

    def start(self) -> PrivateDockerd:
        if self.pid is not None:
            raise DockerEngineError("this engine is already started")
        if len(str(self.exec_root / "containerd" / "containerd.sock.ttrpc")) > 100:
            raise DockerEngineError(f"state dir {self.state_dir} is too long for unix sockets")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "daemon.json").write_text("{}\n")
        (self.state_dir / "client").mkdir(exist_ok=True)
        self._cli = docker_cli()
        bindir = self.state_dir / "bin"
        bindir.mkdir(exist_ok=True)
        link = bindir / "docker"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(self._cli)
        # sh brings lo up in the fresh namespace, then becomes dockerd (same pid: unshare
        # and sh both exec, so the parent-death signal set at the fork reaches dockerd).
        # spawn: a session of its own, stdin from /dev/null, output appended to the log,
        # and -- with die_with_starter -- the parent-death signal and the watchdog.
        script = "ip link set lo up && exec " + shlex.join(self.argv())
        self._popen, tag = spawn(
            ["unshare", "--net", "--", "sh", "-c", script],
            env=dict(os.environ),
            log_path=self.log_path,
            die_with_starter=self.die_with_starter,
        )
        self._tracked = TrackedProcess(self._popen, tag, self.log_path)
        self.pid = self._popen.pid
        self.tag = tag
        self._write_state()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_state(self) -> None:
        state = {
            "pid": self.pid,
            "start": (proc_stat(self.pid) or (0, 0, ""))[1] if self.pid else 0,
        }
        state |= {"data_root": str(self.data_root), "driver": self.storage_driver}
        (self.state_dir / "engine.json").write_text(json.dumps(state, indent=1) + "\n")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            assert self._popen is not None
            if self._popen.poll() is not None:
                raise DockerEngineError(
                    f"dockerd exited with {self._popen.returncode}:\n{self.log_tail()}"
                )
            probe = self.docker("version", "--format", "{{.Server.Version}}", check=False)
            if probe.returncode == 0:
                info = self.docker("info", "--format", "{{.Driver}}", check=False)
                if info.stdout.strip() == self.storage_driver:
                    return
            time.sleep(0.5)
        raise DockerEngineError(
            f"dockerd not ready after {self.start_timeout:.0f}s:\n{self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 90.0) -> list[str]:
        """SIGTERM dockerd (it stops its containers and its containerd), wait, then
        SIGTERM/SIGKILL by pid whatever of its process tree (and of the shims naming our
        exec-root) is left; unmount what it left under the exec-root. Returns the
        processes that survived even SIGKILL (also kept in ``survivors``)."""
        if self.pid is None:
            return []
        tracked = snapshot([self.pid], str(self.exec_root))
        dockerd = next((p for p in tracked if p.pid == self.pid), None)
        if dockerd is not None:
            send_signal(dockerd, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and alive(dockerd):
                if self._popen is not None:
                    self._popen.poll()
                time.sleep(0.2)
        tracked += snapshot([p.pid for p in tracked if alive(p)], str(self.exec_root))
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            left = [p for p in tracked if alive(p)]
            if not left:
                break
            for proc in left:
                send_signal(proc, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(alive(p) for p in left):
                if self._popen is not None:
                    self._popen.poll()
                time.sleep(0.2)
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=5)
        self.survivors = [f"{p.pid}: {p.cmdline[:160]}" for p in tracked if alive(p)]
        if self._tracked is not None:
            # Whatever carries the engine's tag and is still left (nothing, normally),
            # then the watchdog is released: the engine is stopped, nothing to guard.
            left = self._tracked.stop(grace=1.0)
            self.survivors += [f"{p.pid}: {p.cmdline[:160]}" for p in left]
            self._tracked = None
        unmount_under(self.exec_root)
        self.pid = None
        return self.survivors

    def __enter__(self) -> PrivateDockerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- use
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for docker / compose / scripts talking to this engine."""
        env = dict(os.environ if base is None else base)
        env.update(
            {
                "DOCKER_HOST": self.host,
                "DOCKER_CONFIG": str(self.state_dir / "client"),
                "DOCKER_BUILDKIT": "1",
                "COMPOSE_DOCKER_CLI_BUILD": "1",
                "PATH": f"{self.state_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            }
        )
        env.pop("DOCKER_CONTEXT", None)
        env.pop("COMPOSE_FILE", None)
        return env

    def netns(self) -> list[str]:
        """argv prefix that runs a host command in the engine's network namespace."""
        if self.pid is None:
            raise DockerEngineError("the engine is not running")
        return ["nsenter", f"--net=/proc/{self.pid}/ns/net", "--"]

    def client(self) -> DockerClient:
        return DockerClient(self._cli or docker_cli(), self.env())

    def docker(
        self, *args: str, check: bool = True, timeout: float = 120.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self.client().run(*args, check=check, timeout=timeout, input=input)

    def interfaces(self) -> list[str]:
        """Network interfaces of the engine's namespace."""
        proc = subprocess.run(
            [*self.netns(), "ip", "-o", "link", "show"], capture_output=True, text=True
        )
        names = []
        for line in proc.stdout.splitlines():
            parts = line.split(":", 2)
            if len(parts) >= 2:
                names.append(parts[1].strip().split("@")[0])
        return names

    def prune(self, keep_storage: str = "8GB") -> None:
        """Drop dangling images and build cache beyond ``keep_storage`` (the cache stays
        bounded across runs); never fails the caller."""
        commands = [
            ("image", "prune", "-f"),
            ("builder", "prune", "-f", "--keep-storage", keep_storage),
        ]
        for args in commands:
            with contextlib.suppress(DockerEngineError, subprocess.TimeoutExpired):
                self.docker(*args, check=False, timeout=300)


def start_engine(
    state_dir: Path,
    data_base: Path,
    drivers: Sequence[str] = STORAGE_DRIVERS,
    *,
    die_with_starter: bool = True,
) -> PrivateDockerd:
    """Start on the first storage driver that works, with the data-root
    ``<data_base>/<driver>``. A data-root the daemon fails on (stale, partial) is wiped
    and tried once more before the next driver. ``die_with_starter``: as
    :class:`PrivateDockerd`'s."""
    errors: list[str] = []
    for driver in drivers:
        root = data_base / driver
        for attempt in (1, 2):
            engine = PrivateDockerd(state_dir, root, driver, die_with_starter=die_with_starter)
            try:
                return engine.start()
            except DockerEngineError as err:
                errors.append(f"{driver} (attempt {attempt}): {err}")
                if attempt == 1 and root.exists() and any(root.iterdir()):
                    remove_tree(root)
                    continue
                break
    raise DockerEngineError("dockerd did not start:\n" + "\n".join(errors))
