"""Helpers for the deployment tests (tests/test_deploy_*.py): tiny offline assets, a
``Deployment`` that is always stopped by pid with a leak check, the run settings.

Not a test module (``__test__ = False``).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flower_app.deploy.certs import CertificateSet
from flower_app.deploy.processes import Deployment, thread_env
from tests.fixtures import make_sentiment_task, make_tiny_bert
from tests.flower_harness import LeakedProcessesError, live_processes

__test__ = False

ROOT = Path(__file__).resolve().parent.parent


def tiny_assets(base: Path) -> tuple[Path, Path]:
    """The tiny random BERT and the 240/80-example sentiment task (offline)."""
    return make_tiny_bert(base / "model"), make_sentiment_task(base / "task")


def node_env(base: Path) -> dict[str, str]:
    """Environment of every deployment process: offline, a private derived cache, one
    BLAS/OpenMP thread per process (several nodes share two cores)."""
    return {
        "HF_HUB_OFFLINE": "1",
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
