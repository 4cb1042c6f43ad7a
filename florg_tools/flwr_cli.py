"""Calls to the ``flwr`` CLI (``run_flwr``, ``flwr_env``, ``query_run_status``, ``stop_run``)
and ``run_flower_app``: run a Flower App and report whether the run really succeeded.

``flwr run --stream`` exits 0 even when the ServerApp crashes, so ``run_flower_app``
validates the run config, submits the run (``flwr run <app> <connection> --format json
--run-config F.toml``; ``<app>`` a staged copy, ``florg_tools.app_stage``), streams its log
(``flwr log <run-id> <connection> --stream``) and reads the final status (``flwr ls
<connection> --run-id N --format json``), failing unless it is ``finished:completed``.
Every ``flwr`` command runs with ``FLWR_HOME``,
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (else the SuperLink builds a fresh
environment for the app) and this interpreter's ``bin`` first on ``PATH`` (where the
SuperLink finds ``flower-superexec`` and ``flwr-simulation``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from florg_tools.app_stage import stage_app
from florg_tools.flwr_home import CONFIG_FILE_NAME, default_flwr_home, read_flower_config
from florg_tools.processes import terminate_tree
from florg_tools.provenance import checkout_commit
from florg_tools.run_config import (
    app_run_config,
    check_run_config_keys,
    check_run_config_value,
    flatten_run_config,
    write_run_config_toml,
)

# The run setting that records the commit of the app's checkout (florg_tools/provenance.py).
PROVENANCE_KEY = "app-commit"

__all__ = [
    "STATUS_COMPLETED",
    "STATUS_FAILED",
    "STATUS_NOT_STARTED",
    "STATUS_STOPPED",
    "STATUS_UNKNOWN",
    "LaunchError",
    "RunOutcome",
    "connection_names",
    "console_script",
    "flwr_env",
    "parse_cli_json",
    "query_run_status",
    "resolve_flwr_home",
    "run_flower_app",
    "run_flwr",
    "stop_run",
    "strip_ansi",
]

STATUS_COMPLETED = "finished:completed"
STATUS_FAILED = "finished:failed"
STATUS_STOPPED = "finished:stopped"
# Pseudo-statuses used by this module (never reported by Flower itself).
STATUS_NOT_STARTED = "not-started"
STATUS_UNKNOWN = "unknown"

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class LaunchError(RuntimeError):
    """The run could not be submitted or monitored (bad connection, CLI failure, ...)."""


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


def console_script(name: str) -> list[str]:
    """The argv that runs the console script ``name`` (``flwr``, ``flower-superlink``, ...)
    of this interpreter's environment: its ``bin`` first, then ``PATH``."""
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


def run_flwr(
    args: list[str], env: Mapping[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``flwr ARGS`` with its output captured; ``LaunchError`` if it outlives ``timeout``."""
    try:
        return subprocess.run(
            [*console_script("flwr"), *args],
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1.0),
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise LaunchError(f"`flwr {' '.join(args)}` did not answer in {timeout:.0f}s") from err


def parse_cli_json(text: str) -> dict[str, Any] | None:
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


def strip_ansi(text: str) -> str:
    """``text`` without ANSI colour/cursor escape sequences."""
    return _ANSI_RE.sub("", text)


def resolve_flwr_home(arg: Path | None) -> Path:
    """The Flower home: ``arg``, else ``$FLWR_HOME``, else ``<repo>/.flwr_home``."""
    if arg is not None:
        return arg.expanduser().resolve()
    if os.environ.get("FLWR_HOME"):
        return Path(os.environ["FLWR_HOME"]).expanduser().resolve()
    return default_flwr_home()


# --------------------------------------------------------------------------------------
# Run status
# --------------------------------------------------------------------------------------


def query_run_status(
    run_id: int, connection: str, env: Mapping[str, str], timeout: float = 60.0
) -> tuple[str, str]:
    """``(status, status_details)`` of a run, from ``flwr ls --run-id N --format json``."""
    proc = run_flwr(["ls", connection, "--run-id", str(run_id), "--format", "json"], env, timeout)
    payload = parse_cli_json(proc.stdout)
    if payload is None or not payload.get("success"):
        error = (payload or {}).get("error-message") or (proc.stdout + proc.stderr).strip()
        raise LaunchError(f"`flwr ls --run-id {run_id}` failed: {strip_ansi(str(error))}")
    for run in payload.get("runs", []):
        if str(run.get("run-id")) == str(run_id):
            return str(run.get("status", STATUS_UNKNOWN)), str(run.get("status-details", ""))
    raise LaunchError(f"`flwr ls` does not list run {run_id}")


def stop_run(run_id: int, connection: str, env: Mapping[str, str], timeout: float = 60.0) -> bool:
    """Ask the SuperLink to stop a run (``flwr stop``); True if the command succeeded."""
    try:
        proc = run_flwr(["stop", str(run_id), connection, "--format", "json"], env, timeout)
    except LaunchError:
        return False
    payload = parse_cli_json(proc.stdout)
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


def connection_names(flwr_home: Path) -> tuple[list[str], str | None]:
    """The connections of ``<flwr_home>/config.toml`` and its ``[superlink].default``."""
    superlink = read_flower_config(flwr_home).get("superlink", {})
    if not isinstance(superlink, dict):
        return [], None
    names = [k for k, v in superlink.items() if isinstance(v, dict)]
    default = superlink.get("default")
    return names, default if isinstance(default, str) else None


# Lines of Flower's log that the console leaves out (the run's log_text keeps them):
# flwr-simulation 1.42 warns of its changed default federation size in every run, even when
# the connection sets num-supernodes, as every connection the florg tooling writes does; the
# next line gives the real size ("Federation ... (N simulated SuperNodes)").
NOT_ECHOED = ("default simulated SuperNodes changed from 10 to 2",)


def _stream_process(proc: subprocess.Popen[str], sink: IO[str] | None, lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if sink is not None and not any(text in line for text in NOT_ECHOED):
            with contextlib.suppress(ValueError, OSError):
                sink.write(line)
                sink.flush()


def validate_run_config(
    app_dir: Path | str,
    run_config: Mapping[str, Any] | None,
    validate: Callable[[dict[str, Any]], None] | None = None,
    *,
    check_keys: bool = True,
) -> dict[str, Any]:
    """The effective run config of ``run_config``'s overrides on the app's defaults, after
    the checks ``run_flower_app`` makes before it submits anything: unknown keys
    (``check_keys``), each value's TOML type, then ``validate`` on the whole."""
    app_dir = Path(app_dir).expanduser().resolve()
    overrides = flatten_run_config(run_config or {})
    if check_keys:
        effective = check_run_config_keys(app_dir, overrides)
    else:
        effective = {**app_run_config(app_dir), **overrides}
    for key, value in overrides.items():
        check_run_config_value(key, value)
    if validate is not None:
        validate(dict(effective))
    return dict(effective)


def run_flower_app(
    app_dir: Path | str,
    connection: str | None,
    run_config: Mapping[str, Any] | None,
    flwr_home: Path | str,
    timeout: float | None = None,
    *,
    validate: Callable[[dict[str, Any]], None] | None = None,
    check_keys: bool = True,
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
    ``<flwr_home>/config.toml``. The log is echoed to ``stream`` (``True``: ``sys.stdout``;
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
    # Provenance: this app's runs record the commit they ran at (its config.json).
    with contextlib.suppress(OSError, ValueError, KeyError):  # not an app: validation says so
        if PROVENANCE_KEY not in overrides and PROVENANCE_KEY in app_run_config(app_dir):
            overrides[PROVENANCE_KEY] = checkout_commit(app_dir) or ""

    # 1. Validate before launching.
    validate_run_config(app_dir, overrides, validate, check_keys=check_keys)

    # 2. Resolve the connection early for a clear error message.
    if not (flwr_home / CONFIG_FILE_NAME).exists():
        raise LaunchError(
            f"{flwr_home / CONFIG_FILE_NAME} does not exist; create it with "
            f"`python -m florg_tools.flwr_home setup --flwr-home {flwr_home}`"
        )
    names, default = connection_names(flwr_home)
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
        # Only the files the FAB can hold: `flwr run` walks every file under the folder.
        staged = stage_app(app_dir, Path(tmp) / "app")
        args = ["run", str(staged), connection, "--format", "json"]
        if overrides:
            args += ["--run-config", str(write_run_config_toml(overrides, Path(tmp) / "run.toml"))]
        proc = run_flwr(args, env, remaining(600.0), cwd=Path(cwd) if cwd else None)
    payload = parse_cli_json(proc.stdout)
    if payload is None or not payload.get("success") or payload.get("run-id") is None:
        error = (payload or {}).get("error-message") or (proc.stdout + proc.stderr).strip()
        error = strip_ansi(str(error)).strip()
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
        [*console_script("flwr"), "log", str(run_id), connection, "--stream"],
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
        _stop_follower(log_proc)
        stop_run(run_id, connection, env, timeout=30.0)
        raise
    finally:
        if log_proc.poll() is None:
            _stop_follower(log_proc)
        reader.join(timeout=5.0)
    log_text = strip_ansi("".join(lines))

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


def _stop_follower(proc: subprocess.Popen[Any], wait: float = 5.0) -> None:
    """Stop the ``flwr log`` follower (SIGTERM, SIGKILL after ``wait``) and reap it."""
    if proc.poll() is not None:
        return
    terminate_tree(proc.pid, timeout=wait)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
