"""Helpers for the deployment tests (tests/test_deploy_*.py): tiny offline assets, a
``Deployment`` that is always stopped by pid with a leak check, the run settings.

Not a test module (``__test__ = False``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from florg_tools.deploy.certs import CertificateSet
from florg_tools.deploy.deployment import Deployment, thread_env
from florg_tools.processes import TrackedProcess
from florg_tools.synthetic import make_sentiment_task, make_tiny_bert
from flower_app.paths import OUTPUT_ROOT_ENV
from tests.harness.flower_harness import LeakedProcessesError, live_processes

__test__ = False

ROOT = Path(__file__).resolve().parents[2]


def tiny_assets(base: Path) -> tuple[Path, Path]:
    """The tiny random BERT and the 240/80-example sentiment task (offline)."""
    return make_tiny_bert(base / "model"), make_sentiment_task(base / "task")


def node_env(base: Path) -> dict[str, str]:
    """Environment of every deployment process: offline, a private derived cache, the
    output root ``base`` (runs write under ``base/outputs``), one BLAS/OpenMP thread per
    process (several nodes share two cores)."""
    return {
        "HF_HUB_OFFLINE": "1",
        OUTPUT_ROOT_ENV: str(Path(base).resolve()),
        "HF_DATASETS_OFFLINE": "1",
        "FLORG_DERIVED_CACHE": str(base / "derived-cache"),
        **thread_env(1),
    }


def run_settings(model: Path, task: Path, out: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "text-fields": "sentence",
        "rank": 2,
        "num-server-rounds": 2,
        "min-train-nodes": 3,
        "min-available-nodes": 3,
        "batch-size": 16,
        "learning-rate": 0.005,
        "output-dir": str(out),
        "run-name": name,
        **extra,
    }


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def deployment(base: Path, certs: CertificateSet | None, **kwargs: Any) -> Iterator[Deployment]:
    """A Deployment under ``base``; on exit -- also when the test failed -- every process
    it started is stopped by pid, then none of the processes seen may still be alive."""
    dep = Deployment(base / "deployment", certs=certs, extra_env=node_env(base), **kwargs)
    failed = True
    try:
        yield dep
        failed = False
    finally:
        survivors = dep.stop()
        leaked = live_processes(dep.recorded())
        for tag in dep.tags():
            leaked += live_processes([], tag)
        leaked = sorted(set(leaked)) + [f"{p.pid}: {p.cmdline[:120]}" for p in survivors]
        if leaked:
            message = "processes survived the deployment shutdown:\n" + "\n".join(leaked)
            if failed:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            else:
                raise LeakedProcessesError(message)


def logs(dep: Deployment) -> str:
    """Every process log of the deployment, for failure messages."""
    return "\n".join(f"===== {p.name} =====\n{p.log_text()[-2500:]}" for p in dep.processes())


class CliProcesses:
    """Command-line processes started by a test (``bash scripts/deploy_local.sh ...``), each
    tracked with everything it spawns; ``stop_all`` stops them by pid (SIGINT first, as a
    user's Ctrl-C) and returns what survived."""

    def __init__(self, base: Path, env: dict[str, str]) -> None:
        self.base, self.env = base, env
        self.started: list[tuple[str, TrackedProcess]] = []

    def start(self, name: str, argv: list[str]) -> TrackedProcess:
        log = self.base / f"{name}.log"
        with log.open("ab") as fh:
            popen = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        tracker = TrackedProcess(popen, None, log)  # no tag: its descendants are tracked
        tracker.start_tracking()
        self.started.append((name, tracker))
        return tracker

    def interrupt(self, tracker: TrackedProcess, wait: float = 60.0) -> int | None:
        """SIGINT (Ctrl-C) to the process itself; its exit code, None if still running."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(tracker.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return tracker.popen.wait(timeout=wait)
        return None

    def stop_all(self) -> list[str]:
        for _, tracker in reversed(self.started):
            if tracker.popen.poll() is None:
                self.interrupt(tracker, wait=30.0)
            tracker.stop()
        return live_processes([info for _, t in self.started for info in t.recorded()])

    def logs(self) -> str:
        return "\n".join(
            f"===== {name} =====\n{t.log_path.read_text(errors='replace')[-3000:]}"
            for name, t in self.started
        )


def wait_for_text(tracker: TrackedProcess, text: str, timeout: float) -> str:
    """The tracked process's log once it contains ``text``; AssertionError otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = tracker.log_path.read_text(errors="replace")
        if text in log:
            return log
        if tracker.popen.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in the log of {tracker.popen.args}:\n{log[-3000:]}")
