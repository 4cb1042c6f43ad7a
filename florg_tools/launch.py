"""Launch this Flower App with ``flwr run`` and report whether the run really succeeded.

``flwr run --stream`` exits 0 even when the ServerApp crashes, so this launcher

1. optionally validates the run config (unknown keys; a caller-supplied ``validate``),
2. submits the run with ``flwr run <app> <connection> --format json --run-config F.toml``
   (the JSON reply carries the run id; the overrides travel as a temporary TOML file),
3. streams the run's log live with ``flwr log <run-id> <connection> --stream``,
4. reads the final status with ``flwr ls <connection> --run-id N --format json``
   (``finished:completed`` | ``finished:failed`` | ``finished:stopped``; while running:
   ``pending`` | ``starting`` | ``running``) and fails unless it is ``finished:completed``.

All ``flwr`` commands run with ``FLWR_HOME`` and
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (otherwise the SuperLink builds a fresh
environment for the app), and with this interpreter's ``bin`` directory first on ``PATH``
(the SuperLink finds ``flower-superexec``/``flwr-simulation`` through ``PATH``).

It also manages a private simulation SuperLink (``local_superlink``): one
``flower-superlink --simulation`` on a free port, stopped together with every process it
spawned (SuperExec, ``flwr-simulation``, the Ray cluster). All of those inherit a unique
environment tag, which is how they are found again even after they re-parent.

Command line::

    python -m florg_tools.launch [--connection local-simulation] [--app .]
        [--run-config-file F.toml] [--preset NAME] [--set key=value ...]
        [--flwr-home DIR] [--timeout S] [--validate-with MODULE:FUNCTION]
        [--ephemeral-superlink] [--resume RUN_DIR] [--quiet]

Overrides are layered file < ``--preset`` < ``--set``. ``--resume RUN_DIR`` submits the
settings of ``RUN_DIR/config.json`` with ``resume=RUN_DIR`` (the ServerApp continues from the
last checkpointed round; ``--set`` may still change e.g. ``num-server-rounds``).

Exit status: 0 finished:completed; 1 the run failed, was stopped or its status is
unknown; 2 bad usage or run config; 3 timed out (the run is stopped); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import tomli_w  # a dependency of flwr

from florg_tools.flwr_home import (
    CONFIG_FILE_NAME,
    DEFAULT_CONNECTION_NAME,
    LOCAL_SUPERLINK_ADDRESS,
    default_flwr_home,
    ray_address_env,
    read_flower_config,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "STATUS_COMPLETED",
    "STATUS_FAILED",
    "STATUS_NOT_STARTED",
    "STATUS_STOPPED",
    "STATUS_UNKNOWN",
    "TAG_ENV_VAR",
    "ConfigValidationError",
    "LaunchError",
    "ProcInfo",
    "RunConfigValue",
    "RunOutcome",
    "SuperLinkProcess",
    "app_run_config",
    "check_run_config_keys",
    "find_free_port",
    "flatten_run_config",
    "flwr_env",
    "local_superlink",
    "main",
    "parse_set_value",
    "query_run_status",
    "run_flower_app",
    "start_local_superlink",
    "stop_run",
    "write_run_config_toml",
]

RunConfigValue = str | int | float | bool

STATUS_COMPLETED = "finished:completed"
STATUS_FAILED = "finished:failed"
STATUS_STOPPED = "finished:stopped"
# Pseudo-statuses used by this module (never reported by Flower itself).
STATUS_NOT_STARTED = "not-started"
STATUS_UNKNOWN = "unknown"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_INTERRUPTED = 130

TAG_ENV_VAR = "FLORG_SUPERLINK_TAG"
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class LaunchError(RuntimeError):
    """The run could not be submitted or monitored (bad connection, CLI failure, ...)."""


class ConfigValidationError(ValueError):
    """The run config was rejected before launching."""


@dataclass(frozen=True)
class RunOutcome:
    """What happened to one ``flwr run``.

    ``ok`` is true only for the status ``finished:completed``. ``run_id`` is ``None`` when
    the SuperLink never accepted the run (``status == "not-started"``). ``log_text`` is
    the run's streamed log (ANSI colours stripped); ``message`` a one-line explanation.
    """

    run_id: int | None
    status: str
    ok: bool
    log_text: str
    message: str = ""
    status_details: str = ""
    timed_out: bool = False


# --------------------------------------------------------------------------------------
# Environment and flwr CLI invocation
# --------------------------------------------------------------------------------------


def _bin_dir() -> Path:
    # Not resolved: in a venv, sys.executable is a symlink living in the venv's bin/.
    return Path(sys.executable).parent


def _console_script(name: str) -> list[str]:
    candidate = _bin_dir() / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    found = shutil.which(name)
    if found:
        return [found]
    if name == "flwr":
        return [sys.executable, "-c", "from flwr.cli.app import app; app()"]
    raise LaunchError(f"cannot find the `{name}` executable (is flwr installed?)")


def flwr_env(
    flwr_home: Path,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for ``flwr``/``flower-superlink`` subprocesses."""
    env = dict(os.environ if base is None else base)
    env["FLWR_HOME"] = str(Path(flwr_home).expanduser().resolve())
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env["PYTHONUNBUFFERED"] = "1"
    bin_dir = str(_bin_dir())
    path_entries = env.get("PATH", "").split(os.pathsep) if env.get("PATH") else []
    if bin_dir not in path_entries:
        env["PATH"] = os.pathsep.join([bin_dir, *path_entries])
    if extra:
        env.update(extra)
    return env


def _run_flwr(
    args: list[str], env: Mapping[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [*_console_script("flwr"), *args],
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1.0),
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise LaunchError(f"`flwr {' '.join(args)}` did not answer in {timeout:.0f}s") from err


def _parse_cli_json(text: str) -> dict[str, Any] | None:
    """The JSON object printed by a ``flwr ... --format json`` command, if any."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "success" in obj:
            return obj
    return None


def _strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


# --------------------------------------------------------------------------------------
# Run config
# --------------------------------------------------------------------------------------


def flatten_run_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested tables to Flower's dotted keys (``{"a": {"b": 1}} -> {"a.b": 1}``)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_run_config(value, full))
        else:
            flat[full] = value
    return flat


def app_run_config(app_dir: Path) -> dict[str, Any]:
    """The flattened ``[tool.flwr.app.config]`` defaults of the app in ``app_dir``."""
    pyproject = Path(app_dir) / "pyproject.toml"
    try:
        with pyproject.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as err:
        raise ConfigValidationError(f"{pyproject} not found: not a Flower App") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigValidationError(f"{pyproject} is not valid TOML: {err}") from err
    app = data.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(app, dict):
        raise ConfigValidationError(f"{pyproject} has no [tool.flwr.app] section")
    return flatten_run_config(app.get("config", {}))


def check_run_config_keys(app_dir: Path, run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Reject keys the app does not declare; return the effective (merged) run config.

    Flower's SuperLink rejects unknown override keys too, but only after building and
    uploading the FAB, and with a less helpful message.
    """
    defaults = app_run_config(app_dir)
    overrides = flatten_run_config(run_config)
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConfigValidationError(
            f"unknown run-config key(s) {', '.join(unknown)}; the app declares: "
            f"{', '.join(sorted(defaults)) or '(none)'}"
        )
    return {**defaults, **overrides}


def _check_value(key: str, value: Any) -> None:
    if isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigValidationError(f"run-config value for {key!r} is not finite: {value}")
        return
    raise ConfigValidationError(
        f"run-config value for {key!r} must be str, int, float or bool, got {type(value).__name__}"
    )


def write_run_config_toml(run_config: Mapping[str, Any], path: Path) -> Path:
    """Write overrides as a TOML file for ``flwr run --run-config path.toml``.

    ``flwr`` flattens the file's tables into dotted keys, so the key ``"a.b"`` is written
    as the dotted TOML key ``a.b``. ``path`` must end in ``.toml`` (that is how ``flwr``
    tells a file from an inline ``"k=v"`` string).
    """
    path = Path(path)
    if path.suffix != ".toml":
        raise ValueError(f"{path}: flwr only accepts run-config files ending in .toml")
    nested: dict[str, Any] = {}
    for key, value in flatten_run_config(run_config).items():
        _check_value(key, value)
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigValidationError(f"run-config key {key!r} clashes with {part!r}")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigValidationError(f"run-config key {key!r} is also a table")
        node[parts[-1]] = value
    path.write_text(tomli_w.dumps(nested), encoding="utf-8")
    return path


def parse_set_value(text: str) -> RunConfigValue:
    """``--set`` value: a TOML literal (``3``, ``0.5``, ``true``, ``"s"``) or a bare string."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if isinstance(value, bool | int | float | str):
        return value
    return text


# --------------------------------------------------------------------------------------
# Run status
# --------------------------------------------------------------------------------------


def query_run_status(
    run_id: int, connection: str, env: Mapping[str, str], timeout: float = 60.0
) -> tuple[str, str]:
    """``(status, status_details)`` of a run, from ``flwr ls --run-id N --format json``."""
    proc = _run_flwr(["ls", connection, "--run-id", str(run_id), "--format", "json"], env, timeout)
    payload = _parse_cli_json(proc.stdout)
    if payload is None or not payload.get("success"):
        error = (payload or {}).get("error-message") or (proc.stdout + proc.stderr).strip()
        raise LaunchError(f"`flwr ls --run-id {run_id}` failed: {_strip_ansi(str(error))}")
    for run in payload.get("runs", []):
        if str(run.get("run-id")) == str(run_id):
            return str(run.get("status", STATUS_UNKNOWN)), str(run.get("status-details", ""))
    raise LaunchError(f"`flwr ls` does not list run {run_id}")


def stop_run(run_id: int, connection: str, env: Mapping[str, str], timeout: float = 60.0) -> bool:
    """Ask the SuperLink to stop a run (``flwr stop``); True if the command succeeded."""
    try:
        proc = _run_flwr(["stop", str(run_id), connection, "--format", "json"], env, timeout)
    except LaunchError:
        return False
    payload = _parse_cli_json(proc.stdout)
    return bool(payload and payload.get("success"))


def _wait_for_final_status(
    run_id: int, connection: str, env: Mapping[str, str], wait: float
) -> tuple[str, str]:
    deadline = time.monotonic() + wait
    status, details = STATUS_UNKNOWN, ""
    while True:
        status, details = query_run_status(run_id, connection, env)
        if status.startswith("finished") or time.monotonic() >= deadline:
            return status, details
        time.sleep(1.0)


# --------------------------------------------------------------------------------------
# flwr run
# --------------------------------------------------------------------------------------


def _connection_names(flwr_home: Path) -> tuple[list[str], str | None]:
    superlink = read_flower_config(flwr_home).get("superlink", {})
    if not isinstance(superlink, dict):
        return [], None
    names = [k for k, v in superlink.items() if isinstance(v, dict)]
    default = superlink.get("default")
    return names, default if isinstance(default, str) else None


def _stream_process(proc: subprocess.Popen[str], sink: IO[str] | None, lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if sink is not None:
            with contextlib.suppress(ValueError, OSError):
                sink.write(line)
                sink.flush()


def run_flower_app(
    app_dir: Path | str,
    connection: str | None,
    run_config: Mapping[str, Any] | None,
    flwr_home: Path | str,
    timeout: float | None = None,
    *,
    validate: Callable[[dict[str, Any]], None] | None = None,
    check_keys: bool = True,
    federation_config: Mapping[str, RunConfigValue] | None = None,
    stream: IO[str] | None | bool = True,
    final_status_wait: float = 60.0,
    cwd: Path | str | None = None,
) -> RunOutcome:
    """Run the Flower App in ``app_dir`` on ``connection`` and wait for its final status.

    ``run_config`` holds overrides of ``[tool.flwr.app.config]`` (flat dotted keys or
    nested tables). Before anything is submitted, unknown keys are rejected
    (``check_keys``) and ``validate`` is called with the *effective* run config (the app's
    defaults merged with the overrides); either raises ``ConfigValidationError`` (or
    whatever ``validate`` raises). ``connection=None`` uses ``[superlink].default`` of
    ``<flwr_home>/config.toml``. ``federation_config`` is passed as
    ``--federation-config`` (e.g. ``{"num-supernodes": 4}``), the non-deprecated way to
    size a simulation. The log is echoed to ``stream`` (``True``: ``sys.stdout``;
    ``None``/``False``: silent). ``timeout`` (seconds, whole run) stops the run when hit.

    Raises ``LaunchError`` when ``flwr`` itself cannot be used (unknown connection,
    SuperLink unreachable while monitoring); a run that the SuperLink refuses or that
    fails is reported through ``RunOutcome`` (``ok=False``), never raised.
    """
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    app_dir = Path(app_dir).expanduser().resolve()
    flwr_home = Path(flwr_home).expanduser().resolve()
    sink: IO[str] | None = sys.stdout if stream is True else (stream or None)
    overrides = flatten_run_config(run_config or {})

    # 1. Validate before launching.
    if check_keys:
        effective = check_run_config_keys(app_dir, overrides)
    else:
        effective = {**app_run_config(app_dir), **overrides}
    for key, value in overrides.items():
        _check_value(key, value)
    if validate is not None:
        validate(dict(effective))

    # 2. Resolve the connection early for a clear error message.
    if not (flwr_home / CONFIG_FILE_NAME).exists():
        raise LaunchError(
            f"{flwr_home / CONFIG_FILE_NAME} does not exist; create it with "
            f"`python -m florg_tools.flwr_home setup --flwr-home {flwr_home}`"
        )
    names, default = _connection_names(flwr_home)
    connection = connection or default
    if connection is None or connection not in names:
        raise LaunchError(
            f"connection {connection!r} not found in {flwr_home / CONFIG_FILE_NAME} "
            f"(available: {', '.join(names) or 'none'})"
        )
    env = flwr_env(flwr_home)

    def remaining(default_wait: float) -> float:
        if deadline is None:
            return default_wait
        return max(1.0, min(default_wait, deadline - time.monotonic()))

    # 3. Submit.
    with tempfile.TemporaryDirectory(prefix="flwr-run-config-") as tmp:
        args = ["run", str(app_dir), connection, "--format", "json"]
        if overrides:
            args += ["--run-config", str(write_run_config_toml(overrides, Path(tmp) / "run.toml"))]
        if federation_config:
            args += ["--federation-config", _inline_config(federation_config)]
        proc = _run_flwr(args, env, remaining(600.0), cwd=Path(cwd) if cwd else None)
    payload = _parse_cli_json(proc.stdout)
    if payload is None or not payload.get("success") or payload.get("run-id") is None:
        error = (payload or {}).get("error-message") or (proc.stdout + proc.stderr).strip()
        error = _strip_ansi(str(error)).strip()
        # flwr prefixes the error with everything the command printed; the cause is last.
        last = next((ln.strip() for ln in reversed(error.splitlines()) if ln.strip()), "")
        message = f"`flwr run` did not start the run: {last or 'no output'}"
        if sink is not None:
            print(f"[launch] {message}", file=sink, flush=True)
        return RunOutcome(None, STATUS_NOT_STARTED, False, "", message, status_details=error)
    run_id = int(payload["run-id"])
    if sink is not None:
        print(f"[launch] started run {run_id} on connection '{connection}'", file=sink, flush=True)

    # 4. Stream the log until the run finishes (or the deadline passes).
    lines: list[str] = []
    log_proc = subprocess.Popen(
        [*_console_script("flwr"), "log", str(run_id), connection, "--stream"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )
    reader = threading.Thread(target=_stream_process, args=(log_proc, sink, lines), daemon=True)
    reader.start()
    timed_out = False
    try:
        try:
            log_proc.wait(
                timeout=None if deadline is None else max(0.0, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            timed_out = True
    except BaseException:  # KeyboardInterrupt: stop the run rather than orphan it
        _terminate(log_proc)
        stop_run(run_id, connection, env, timeout=30.0)
        raise
    finally:
        if log_proc.poll() is None:
            _terminate(log_proc)
        reader.join(timeout=5.0)
    log_text = _strip_ansi("".join(lines))

    # 5. Final status.
    if timed_out:
        stop_run(run_id, connection, env, timeout=60.0)
        try:
            status, details = _wait_for_final_status(run_id, connection, env, 30.0)
        except LaunchError as err:
            status, details = STATUS_UNKNOWN, str(err)
        message = f"run {run_id} timed out after {timeout:.0f}s and was stopped (status {status})"
        if sink is not None:
            print(f"[launch] {message}", file=sink, flush=True)
        return RunOutcome(run_id, status, False, log_text, message, details, timed_out=True)
    try:
        status, details = _wait_for_final_status(run_id, connection, env, final_status_wait)
    except LaunchError as err:
        message = f"could not read the status of run {run_id}: {err}"
        return RunOutcome(run_id, STATUS_UNKNOWN, False, log_text, message)
    ok = status == STATUS_COMPLETED
    elapsed = time.monotonic() - started
    if ok:
        message = f"run {run_id} {status} in {elapsed:.1f}s"
    else:
        message = f"run {run_id} did not complete: status {status}"
        if details and details != "N/A":
            message += f" ({details})"
    return RunOutcome(run_id, status, ok, log_text, message, details)


def _inline_config(config: Mapping[str, RunConfigValue]) -> str:
    parts = []
    for key, value in config.items():
        _check_value(key, value)
        rendered = tomli_w.dumps({"v": value}).strip()[len("v = ") :]
        if isinstance(value, str) and "'" not in value:
            rendered = f"'{value}'"  # flwr's "k=v" parser splits double quotes badly
        parts.append(f"{key}={rendered}")
    return " ".join(parts)


def _terminate(proc: subprocess.Popen[Any], wait: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------------------
# Private simulation SuperLink and process bookkeeping
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcInfo:
    """One process. ``start_time`` (seconds since the epoch, like ``psutil``'s
    ``create_time()``) tells it apart from a later process that reuses the pid."""

    pid: int
    ppid: int
    pgid: int
    start_time: float
    zombie: bool
    cmdline: str
    tagged: bool

    @property
    def key(self) -> tuple[int, float]:
        return (self.pid, self.start_time)


_BOOT_TIME: float | None = None


def _boot_time() -> float:
    global _BOOT_TIME
    if _BOOT_TIME is None:
        _BOOT_TIME = 0.0
        with contextlib.suppress(OSError, ValueError):
            for line in Path("/proc/stat").read_text().splitlines():
                if line.startswith("btime "):
                    _BOOT_TIME = float(line.split()[1])
    return _BOOT_TIME


def _read_proc(pid: int, tag: bytes | None) -> ProcInfo | None:
    base = Path("/proc") / str(pid)
    try:
        stat = (base / "stat").read_bytes().decode(errors="replace")
        cmdline = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    # fields[0] is field 3 of proc(5): state, ppid, pgrp, session, ..., starttime (22).
    tagged = False
    if tag is not None:
        try:
            environ = (base / "environ").read_bytes()
        except OSError:
            environ = b""
        tagged = environ.startswith(tag + b"\0") or (b"\0" + tag + b"\0") in environ
    return ProcInfo(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        start_time=_boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK"),
        zombie=fields[0] in ("Z", "X"),
        cmdline=cmdline.strip(),
        tagged=tagged,
    )


def _process_table(tag: str | None) -> dict[int, ProcInfo]:
    """All visible processes (Linux ``/proc``; psutil elsewhere)."""
    tag_bytes = f"{TAG_ENV_VAR}={tag}".encode() if tag else None
    table: dict[int, ProcInfo] = {}
    if Path("/proc/self/stat").exists():
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                info = _read_proc(int(entry.name), tag_bytes)
                if info is not None:
                    table[info.pid] = info
        return table
    import psutil  # non-Linux fallback

    for proc in psutil.process_iter():
        try:
            with proc.oneshot():
                tagged = bool(tag) and proc.environ().get(TAG_ENV_VAR) == tag
                info = ProcInfo(
                    pid=proc.pid,
                    ppid=proc.ppid(),
                    pgid=os.getpgid(proc.pid),
                    start_time=proc.create_time(),
                    zombie=proc.status() == psutil.STATUS_ZOMBIE,
                    cmdline=" ".join(proc.cmdline()),
                    tagged=tagged,
                )
        except (psutil.Error, OSError):
            continue
        table[info.pid] = info
    return table


def _descendants(table: Mapping[int, ProcInfo], root: int) -> list[ProcInfo]:
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: list[ProcInfo] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in table:
            found.append(table[pid])
            todo.extend(children.get(pid, []))
    return found


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, then release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class SuperLinkProcess:
    """A ``flower-superlink --simulation`` started by us, and everything it spawned."""

    popen: subprocess.Popen[bytes]
    host: str
    port: int
    tag: str
    flwr_home: Path
    log_path: Path
    _recorded: dict[tuple[int, float], ProcInfo] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tracker: threading.Thread | None = field(default=None, repr=False)
    _tracking: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def scan(self) -> list[ProcInfo]:
        """Live (non-zombie) processes of this SuperLink: it, its descendants, and every
        process carrying its tag; all of them are also recorded."""
        table = _process_table(self.tag)
        found = {info.pid: info for info in table.values() if info.tagged}
        if self.pid in table:
            found[self.pid] = table[self.pid]
        for info in _descendants(table, self.pid):
            found[info.pid] = info
        live = [info for info in found.values() if not info.zombie]
        with self._lock:
            for info in live:
                self._recorded.setdefault(info.key, info)
        return live

    def recorded(self) -> list[ProcInfo]:
        """Every process seen so far (including the ones that have exited since)."""
        with self._lock:
            return list(self._recorded.values())

    def start_tracking(self, interval: float = 0.25) -> None:
        """Sample the process tree in the background so short-lived children get recorded."""
        if self._tracker is not None:
            return
        self._tracking.set()

        def loop() -> None:
            while self._tracking.is_set():
                with contextlib.suppress(Exception):
                    self.scan()
                time.sleep(interval)

        self._tracker = threading.Thread(target=loop, name="superlink-tracker", daemon=True)
        self._tracker.start()

    def stop_tracking(self) -> None:
        self._tracking.clear()
        if self._tracker is not None:
            self._tracker.join(timeout=5.0)
            self._tracker = None

    def survivors(self) -> list[ProcInfo]:
        """Recorded or tagged processes that are still alive (same pid *and* start time)."""
        table = _process_table(self.tag)
        alive: dict[int, ProcInfo] = {}
        for rec in self.recorded():
            now = table.get(rec.pid)
            if now is not None and now.start_time == rec.start_time and not now.zombie:
                alive[now.pid] = now
        for info in table.values():
            if info.tagged and not info.zombie:
                alive[info.pid] = info
        if self.popen.poll() is None and self.pid in table:
            alive[self.pid] = table[self.pid]
        alive.pop(os.getpid(), None)
        return sorted(alive.values(), key=lambda i: i.pid)

    def stop(self, grace: float = 5.0, kill_timeout: float = 15.0) -> list[ProcInfo]:
        """Stop the SuperLink and every process it spawned; return what survived (empty
        on success). SIGTERM to the SuperLink first (it stops its SuperExec, which stops
        ``flwr-simulation`` and Ray), then SIGTERM and finally SIGKILL to the rest, by pid
        and by process group (only groups led by one of these processes)."""
        self.stop_tracking()
        self.scan()
        if self.popen.poll() is None:
            self.popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace)
        deadline = time.monotonic() + kill_timeout
        sig = signal.SIGTERM
        while True:
            self.scan()
            alive = self.survivors()
            if not alive or time.monotonic() >= deadline:
                break
            own_group = os.getpgrp()
            for info in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(info.pid, sig)
                if info.pgid == info.pid and info.pgid != own_group:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(info.pgid, sig)
            wait_until = min(deadline, time.monotonic() + (3.0 if sig == signal.SIGTERM else 1.0))
            while time.monotonic() < wait_until and self.survivors():
                time.sleep(0.1)
            sig = signal.SIGKILL
        if self.popen.poll() is None:
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        return self.survivors()


def _wait_healthy(proc: subprocess.Popen[bytes], host: str, port: int, timeout: float) -> None:
    url = f"http://{host}:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"flower-superlink exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if 200 <= response.status < 300:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise LaunchError(f"flower-superlink did not become healthy on {host}:{port} in {timeout}s")


def start_local_superlink(
    flwr_home: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: Path | None = None,
    cwd: Path | None = None,
    database: Path | None = None,
    startup_timeout: float = 60.0,
    extra_env: Mapping[str, str] | None = None,
    attempts: int = 3,
) -> SuperLinkProcess:
    """Start ``flower-superlink --insecure --simulation`` on a free port.

    In Flower 1.41 one HTTP port (``--host``/``--port``) serves the Control, Fleet and
    Runtime (ServerAppIo) APIs; ``--control-api-address``/``--fleet-api-address`` are
    deprecated no-ops. The SuperLink runs in its own session; it spawns
    ``flower-superexec`` (another session), which spawns ``flwr-simulation`` and Ray.
    ``cwd`` becomes the ServerApp's working directory. State is in memory unless
    ``database`` is given. Stop it with ``SuperLinkProcess.stop()`` (or use
    ``local_superlink``).
    """
    flwr_home = Path(flwr_home).expanduser().resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path else flwr_home / "superlink.log"
    last_error: Exception | None = None
    for _ in range(max(1, attempts)):
        chosen = port if port is not None else find_free_port(host)
        tag = uuid.uuid4().hex
        command = [
            *_console_script("flower-superlink"),
            "--insecure",
            "--simulation",
            "--host",
            host,
            "--port",
            str(chosen),
            "--disable-runtime-dependency-installation",
        ]
        if database is not None:
            command += ["--database", str(database)]
        env = flwr_env(flwr_home, extra={TAG_ENV_VAR: tag, **(extra_env or {})})
        with log_path.open("ab") as log_file:
            popen = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        superlink = SuperLinkProcess(popen, host, chosen, tag, flwr_home, log_path)
        superlink.start_tracking()
        try:
            _wait_healthy(popen, host, chosen, startup_timeout)
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
    """``start_local_superlink`` as a context manager that always stops it again."""
    superlink = start_local_superlink(flwr_home, **kwargs)
    try:
        yield superlink
    finally:
        leftovers = superlink.stop()
        if leftovers:
            print(
                "[launch] warning: processes survived the SuperLink shutdown: "
                + ", ".join(f"{p.pid} ({p.cmdline[:60]})" for p in leftovers),
                file=sys.stderr,
            )


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _load_validator(spec: str) -> Callable[[dict[str, Any]], None]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigValidationError(f"--validate-with expects 'module:function', got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigValidationError(f"{spec} is not callable")
    func: Callable[[dict[str, Any]], Any] = obj

    def validate(config: dict[str, Any]) -> None:
        try:
            func(config)
        except ConfigValidationError:
            raise
        except Exception as err:  # the validator's own error type, e.g. ConfigError
            raise ConfigValidationError(str(err)) from err

    return validate


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m florg_tools.launch",
        description="Run the Flower App with `flwr run` and fail unless the run completes.",
    )
    parser.add_argument(
        "--connection",
        default=None,
        help=f"SuperLink connection in $FLWR_HOME/config.toml (default: its default, "
        f"normally '{DEFAULT_CONNECTION_NAME}')",
    )
    parser.add_argument("--app", type=Path, default=Path("."), help="Flower App directory")
    parser.add_argument(
        "--run-config-file", type=Path, default=None, help="TOML file of run-config overrides"
    )
    parser.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="a layer between --run-config-file and --set: the app's conf/NAME.toml (or a "
        ".toml path), the file plain `flwr run --run-config` takes",
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run-config override (repeatable; VALUE is a TOML literal or a bare string)",
    )
    parser.add_argument(
        "--flwr-home",
        type=Path,
        default=None,
        help="Flower home (default: $FLWR_HOME if set, else <repo>/.flwr_home)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds; stops the run")
    parser.add_argument(
        "--validate-with",
        default=None,
        metavar="MODULE:FUNCTION",
        help="callable receiving the effective run config; raise to refuse the launch "
        "(default: flower_app.config:resolve_config)",
    )
    parser.add_argument(
        "--ephemeral-superlink",
        action="store_true",
        help="start a private simulation SuperLink on a free port for this run and stop "
        "it (and Ray) afterwards, instead of flwr's detached one for ':local:' connections",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the run whose folder is RUN_DIR from its last checkpointed round: "
        "its config.json is submitted with resume=RUN_DIR (--set may change "
        "num-server-rounds; docs/faults.md)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not echo the run's log")
    return parser


def _resolve_flwr_home(arg: Path | None) -> Path:
    if arg is not None:
        return arg.expanduser().resolve()
    if os.environ.get("FLWR_HOME"):
        return Path(os.environ["FLWR_HOME"]).expanduser().resolve()
    return default_flwr_home()


def resume_run_config(run_dir: Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run config that continues the run in ``run_dir``: the settings of its
    ``config.json`` (those that differ from the defaults), ``resume`` = the folder's absolute
    path, then ``overrides``."""
    from flower_app.config import DEFAULTS

    path = Path(run_dir).expanduser().resolve() / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigValidationError(f"--resume: cannot read {path}: {err}") from err
    if not isinstance(saved, dict) or set(saved) - set(DEFAULTS):
        raise ConfigValidationError(f"--resume: {path} is not a run's config.json")
    saved["preset"] = ""  # every value is resolved already
    config = {k: v for k, v in saved.items() if v != DEFAULTS[k]}
    config["resume"] = str(path.parent)
    config.update(overrides or {})
    return config


def _collect_run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config to submit: ``--run-config-file`` < ``--preset`` (the app's
    ``conf/NAME.toml``, or a ``.toml`` path: the file plain ``flwr run --run-config`` takes)
    < ``--set``, merged here, so the apps receive plain values (flower_app/config.py)."""

    def toml_layer(path: Path, flag: str) -> dict[str, Any]:
        try:
            with path.open("rb") as fh:
                return flatten_run_config(tomllib.load(fh))
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigValidationError(f"{flag} {path}: {err}") from err

    config: dict[str, Any] = {}
    if getattr(args, "resume", None) is not None:
        sets = dict(item.partition("=")[::2] for item in args.sets)
        return resume_run_config(
            args.resume, {k.strip(): parse_set_value(v) for k, v in sets.items()}
        )
    if args.run_config_file is not None:
        config.update(toml_layer(args.run_config_file, "--run-config-file"))
    if args.preset is not None:
        name = str(args.preset)
        path = Path(name) if name.endswith(".toml") else args.app / "conf" / f"{name}.toml"
        config.update(toml_layer(path, "--preset"))
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigValidationError(f"--set expects KEY=VALUE, got {item!r}")
        config[key.strip()] = parse_set_value(value)
    return resolve_layers(config) if is_this_app(args.app) else config


def is_this_app(app_dir: Path) -> bool:
    """Whether ``app_dir`` declares this project's run settings (then they are resolved
    and validated with flower_app.config before launching)."""
    from flower_app.config import DEFAULTS

    try:
        return set(app_run_config(app_dir)) == set(DEFAULTS)
    except (OSError, ValueError, KeyError):
        return False


def resolve_layers(overrides: dict[str, Any]) -> dict[str, Any]:
    """Validate the merged layers with this app's schema and return them unchanged: the
    apps layer nothing themselves, so Flower's defaults + these values is the run config,
    as with plain ``flwr run --run-config F.toml``."""
    from flower_app.config import resolve_config

    resolve_config({}, overrides)
    return dict(overrides)


def _ephemeral_connection(flwr_home: Path, connection: str | None) -> tuple[str, dict[str, Any]]:
    """Copy of ``connection`` (from ``flwr_home``) for a temporary Flower home."""
    names, default = _connection_names(flwr_home)
    name = connection or default or DEFAULT_CONNECTION_NAME
    conn: dict[str, Any] = {}
    if name in names:
        conn = dict(read_flower_config(flwr_home)["superlink"][name])
        if conn.get("address") not in (None, LOCAL_SUPERLINK_ADDRESS, ":local-in-memory:"):
            raise ConfigValidationError(
                f"--ephemeral-superlink needs a local simulation connection; '{name}' "
                f"points at {conn.get('address')}"
            )
    return name, conn


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    flwr_home = _resolve_flwr_home(args.flwr_home)
    sink = None if args.quiet else sys.stdout
    try:
        run_config = _collect_run_config(args)
        default_validator = "flower_app.config:resolve_config" if is_this_app(args.app) else None
        spec = args.validate_with or default_validator
        validate = _load_validator(spec) if spec else None
        if args.ephemeral_superlink:
            with tempfile.TemporaryDirectory(prefix="flwr-home-") as tmp:
                name, conn = _ephemeral_connection(flwr_home, args.connection)
                # A Ray cluster address recorded in the connection reaches flwr-simulation
                # only through the SuperLink's environment (RAY_ADDRESS; docs/deploy-ray.md).
                ray_env = ray_address_env(flwr_home, name)
                with local_superlink(Path(tmp), cwd=Path.cwd(), extra_env=ray_env) as superlink:
                    conn.update(address=superlink.address, insecure=True)
                    (Path(tmp) / CONFIG_FILE_NAME).write_text(
                        tomli_w.dumps({"superlink": {"default": name, name: conn}}),
                        encoding="utf-8",
                    )
                    outcome = run_flower_app(
                        args.app, name, run_config, Path(tmp), args.timeout,
                        validate=validate, stream=sink,
                    )  # fmt: skip
        else:
            outcome = run_flower_app(
                args.app, args.connection, run_config, flwr_home, args.timeout,
                validate=validate, stream=sink,
            )  # fmt: skip
    except ValueError as err:  # ConfigValidationError, or raised by --validate-with
        print(f"error: invalid run config: {err}", file=sys.stderr)
        return EXIT_USAGE
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted; the run was asked to stop", file=sys.stderr)
        return EXIT_INTERRUPTED
    if outcome.ok:
        print(f"[launch] OK: {outcome.message}", file=sys.stderr)
        return EXIT_OK
    print(f"[launch] FAILED: {outcome.message}", file=sys.stderr)
    return EXIT_TIMEOUT if outcome.timed_out else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
