"""A private Docker engine for the compose demo's test: its own ``dockerd`` (and the
``containerd`` it starts) in its OWN network namespace, with its own data-root, exec-root,
socket and config, started and stopped by pid.

Why a network namespace: the engine's network namespace has only a loopback interface, so
the containers (on the compose project's bridge network inside it), the builds and the
ports published on ``127.0.0.1`` can reach each other and that loopback, and nothing
else: no packet can leave the machine, whatever a container tries, and nothing here can
clash with another engine, port 8000 or a bridge of the host. The host reaches the
engine through its unix socket (a file); a host command that must dial the published
ports runs in the namespace (``nsenter --net=/proc/PID/ns/net``, :meth:`PrivateDockerd.netns`).
``--iptables=false --ip-masq=false --ip-forward=false``: the engine touches no firewall
rule and no sysctl.

Storage: ``overlay2`` where the kernel and file system allow it, else ``vfs`` (every
layer a full copy: slow and large, but it works anywhere).

The data-root (images, build cache) can be a stable folder, so that a second run on the
same machine reuses the images: :func:`cached_data_root` gives
``~/.cache/florg-docker/engine-<driver>`` (``$FLORG_DOCKER_CACHE`` moves it), locked
against a concurrent user; a data-root the daemon cannot start on is wiped and started
afresh once.

Command line (the same engine by hand; needs root)::

    python -m florg_tools.deploy.docker_engine start --state-dir /tmp/florg-dockerd
    #   prints the exports for DOCKER_HOST, PATH, ... and the nsenter prefix
    python -m florg_tools.deploy.docker_engine stop --state-dir /tmp/florg-dockerd
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "CACHE_ENV",
    "DockerClient",
    "DockerEngineError",
    "PrivateDockerd",
    "cache_root",
    "cached_data_root",
    "compose_command",
    "docker_cli",
    "engine_prerequisites",
]

CACHE_ENV = "FLORG_DOCKER_CACHE"
STORAGE_DRIVERS = ("overlay2", "vfs")
_REQUIRED_BINARIES = ("dockerd", "containerd", "runc", "docker-proxy", "unshare", "nsenter", "ip")


class DockerEngineError(RuntimeError):
    """The private engine cannot be started or used; the message says why."""


def cache_root() -> Path:
    """``$FLORG_DOCKER_CACHE``, else ``~/.cache/florg-docker``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "florg-docker"


# --------------------------------------------------------------------------- tools


def _client_version(cli: str) -> tuple[int, ...] | None:
    try:
        proc = subprocess.run(
            [cli, "version", "--format", "{{.Client.Version}}"],
            capture_output=True, text=True, timeout=30,
            env={**os.environ, "DOCKER_HOST": "unix:///nonexistent"},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (proc.stdout or "").strip().split("+")[0].split("-")[0]
    try:
        return tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        return None


def docker_cli() -> str:
    """A ``docker`` client that builds with BuildKit (``RUN --mount``): one with the buildx
    plugin, or a classic client older than 23 (those build with BuildKit themselves when
    ``DOCKER_BUILDKIT=1``). The first such of ``docker`` on PATH and ``/usr/bin/docker``
    (Debian's docker.io package)."""
    seen: list[str] = []
    for cand in (shutil.which("docker"), "/usr/bin/docker"):
        if not cand or cand in seen or not os.access(cand, os.X_OK):
            continue
        seen.append(cand)
        buildx = subprocess.run([cand, "buildx", "version"], capture_output=True, timeout=30)
        if buildx.returncode == 0:
            return cand
        version = _client_version(cand)
        if version is not None and version < (23,):
            return cand
    raise DockerEngineError(
        "no docker client that can build with BuildKit: "
        + (", ".join(seen) or "no docker found")
        + " (need the buildx plugin, or Debian's docker.io client: apt-get install docker.io)"
    )


def compose_command(docker: str) -> list[str]:
    """``docker compose`` when the client has the plugin, else ``docker-compose``."""
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
    if probe.returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DockerEngineError("no compose tool: need `docker compose` or docker-compose")


def engine_prerequisites() -> list[str]:
    """Why a private engine cannot start here (empty when it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append(f"dockerd needs root (this process runs as uid {os.geteuid()})")
    missing = [b for b in _REQUIRED_BINARIES if shutil.which(b) is None]
    if missing:
        problems.append(
            "missing " + ", ".join(missing) + " (apt-get install docker.io iproute2 util-linux)"
        )
    if not problems:
        probe = subprocess.run(
            ["unshare", "--net", "true"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode != 0:
            problems.append(
                "cannot create a network namespace (unshare --net): " + probe.stderr.strip()
            )
    return problems


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class _Proc:
    pid: int
    start: int  # /proc/PID/stat field 22 (start time in clock ticks): pid-reuse guard
    cmdline: str


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of a live process, None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .strip()
        )
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _snapshot(roots: Sequence[int], marker: str) -> list[_Proc]:
    """The processes ``roots`` and all their descendants, plus every process whose argv
    names ``marker`` (our exec-root: the containerd shims re-parent away from dockerd)."""
    table: dict[int, tuple[int, int, str]] = {}
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None:
            table[pid] = st
    chosen = {pid for pid in roots if pid in table}
    chosen |= {pid for pid in table if marker and marker in _cmdline(pid)}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _start, _state) in table.items():
            if ppid in chosen and pid not in chosen:
                chosen.add(pid)
                changed = True
    return [_Proc(pid, table[pid][1], _cmdline(pid)) for pid in sorted(chosen)]


def _alive(proc: _Proc) -> bool:
    st = _stat(proc.pid)
    return st is not None and st[1] == proc.start and st[2] not in ("Z", "X")


def _signal(proc: _Proc, sig: int) -> None:
    if _alive(proc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == str(path) or point.startswith(prefix):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def unmount_under(path: Path) -> list[str]:
    """Lazily unmount everything mounted at or below ``path``; what is still mounted."""
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", point], capture_output=True)
    return _mounts_under(path)


def remove_tree(path: Path) -> None:
    """``rm -rf path``, but never through a mount point still below it."""
    if not path.exists():
        return
    left = unmount_under(path)
    if left:
        raise DockerEngineError(f"not removing {path}: still mounted below it: {left[:3]}")
    shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class DockerClient:
    """A ``docker`` client binary and the environment that points it at an engine."""

    cli: str
    env: dict[str, str]

    @classmethod
    def from_environment(cls) -> DockerClient:
        """The engine of this shell (``DOCKER_HOST`` or the default socket), BuildKit on."""
        env = {**os.environ, "DOCKER_BUILDKIT": "1", "COMPOSE_DOCKER_CLI_BUILD": "1"}
        return cls(docker_cli(), env)

    def run(
        self, *args: str, check: bool = True, timeout: float = 120.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.cli, *args], capture_output=True, text=True, env=self.env,
            timeout=timeout, input=input,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise DockerEngineError(
                f"docker {' '.join(args)[:300]} failed ({proc.returncode}):\n"
                f"{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}"
            )
        return proc


# --------------------------------------------------------------------------- the engine


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
    :meth:`stop`; :meth:`stop` (also after a failure) stops every process by pid."""

    state_dir: Path
    data_root: Path
    storage_driver: str = "overlay2"
    start_timeout: float = 120.0
    pid: int | None = None
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)
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
        # sh brings lo up in the fresh namespace, then becomes dockerd (same pid).
        script = "ip link set lo up && exec " + shlex.join(self.argv())
        self._log = self.log_path.open("ab")
        self._popen = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self._popen.pid
        self._write_state()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_state(self) -> None:
        state = {"pid": self.pid, "start": (_stat(self.pid) or (0, 0, ""))[1] if self.pid else 0}
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
        tracked = _snapshot([self.pid], str(self.exec_root))
        dockerd = next((p for p in tracked if p.pid == self.pid), None)
        if dockerd is not None:
            _signal(dockerd, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and _alive(dockerd):
                if self._popen is not None:
                    self._popen.poll()
                time.sleep(0.2)
        tracked += _snapshot([p.pid for p in tracked if _alive(p)], str(self.exec_root))
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            left = [p for p in tracked if _alive(p)]
            if not left:
                break
            for proc in left:
                _signal(proc, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(_alive(p) for p in left):
                if self._popen is not None:
                    self._popen.poll()
                time.sleep(0.2)
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None
        self.survivors = [f"{p.pid}: {p.cmdline[:160]}" for p in tracked if _alive(p)]
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
    state_dir: Path, data_base: Path, drivers: Sequence[str] = STORAGE_DRIVERS
) -> PrivateDockerd:
    """Start on the first storage driver that works, with the data-root
    ``<data_base>/<driver>``. A data-root the daemon fails on (stale, partial) is wiped
    and tried once more before the next driver."""
    errors: list[str] = []
    for driver in drivers:
        root = data_base / driver
        for attempt in (1, 2):
            engine = PrivateDockerd(state_dir, root, driver)
            try:
                return engine.start()
            except DockerEngineError as err:
                errors.append(f"{driver} (attempt {attempt}): {err}")
                if attempt == 1 and root.exists() and any(root.iterdir()):
                    remove_tree(root)
                    continue
                break
    raise DockerEngineError("dockerd did not start:\n" + "\n".join(errors))


# --------------------------------------------------------------------------- CLI


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m florg_tools.deploy.docker_engine")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a private dockerd in its own network namespace")
    s.add_argument("--state-dir", type=Path, default=Path("/tmp/florg-dockerd"))
    s.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="folder of the data-roots, one per storage driver (default: the cache's; "
        "do not share it with a test run in progress)",
    )
    s.add_argument("--storage-driver", choices=STORAGE_DRIVERS, default=None)
    t = sub.add_parser("stop", help="stop the dockerd started with `start` (by pid)")
    t.add_argument("--state-dir", type=Path, default=Path("/tmp/florg-dockerd"))
    args = p.parse_args(argv)
    state_dir = args.state_dir.resolve()
    if args.command == "start":
        problems = engine_prerequisites()
        if problems:
            print("error: " + "; ".join(problems), file=sys.stderr)
            return 2
        data_base = args.data_root or cache_root() / "engine"
        drivers = (args.storage_driver,) if args.storage_driver else STORAGE_DRIVERS
        try:
            engine = start_engine(state_dir, data_base.resolve(), drivers)
        except DockerEngineError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        env = engine.env({})
        for key in ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_BUILDKIT", "COMPOSE_DOCKER_CLI_BUILD"):
            print(f"export {key}={shlex.quote(env[key])}")
        print(f'export PATH={shlex.quote(str(state_dir / "bin"))}:"$PATH"')
        print(f"# dockerd pid {engine.pid} ({engine.storage_driver}); host commands that dial")
        print(f"# the published ports: {shlex.join(engine.netns())} COMMAND")
        engine._popen = None  # leave it running: `stop` finds it by its recorded pid
        return 0
    try:
        state: dict[str, Any] = json.loads((state_dir / "engine.json").read_text())
    except (OSError, ValueError) as err:
        print(f"error: no engine state in {state_dir}: {err}", file=sys.stderr)
        return 1
    st = _stat(int(state["pid"]))
    if st is None or st[1] != int(state["start"]):
        print(f"no dockerd with pid {state['pid']} is running", file=sys.stderr)
        return 0
    engine = PrivateDockerd(state_dir, Path(state["data_root"]), state["driver"])
    engine.pid = int(state["pid"])
    survivors = engine.stop()
    for line in survivors:
        print(f"survived: {line}", file=sys.stderr)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(_main())
