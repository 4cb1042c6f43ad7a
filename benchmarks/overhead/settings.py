"""Simulation overhead: the pinned run config of both measurements (and of
``deployment_overhead``), and the sizes it is built from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGET_RATIO = 1.3
RUN_NAME = "simulation-overhead"


@dataclass(frozen=True)
class Sizes:
    rounds: int
    clients: int
    max_train: int
    max_eval: int
    batch_size: int
    max_seq_length: int


def run_settings(sizes: Sizes, output_dir: Path) -> dict[str, Any]:
    """The run config of both measurements (every setting that matters is pinned, so a
    change of the app's defaults cannot make the two sides differ)."""
    return {
        "method": "florg",
        "model": "all-MiniLM-L6-v2",
        "task": "snli",
        "partitioner": "iid",
        "seed": 0,
        "rank": 4,
        "alpha": 16.0,
        "num-server-rounds": sizes.rounds,
        "fraction-train": 1.0,
        "min-train-nodes": sizes.clients,
        "min-available-nodes": sizes.clients,
        "client-eval": "off",
        "max-train-examples": sizes.max_train,
        "max-eval-examples": sizes.max_eval,
        "local-epochs": 1,
        "local-steps": 0,
        "batch-size": sizes.batch_size,
        "eval-batch-size": 64,
        "learning-rate": 1e-3,
        "weight-decay": 0.0,
        "max-seq-length": sizes.max_seq_length,
        "aggregation-weights": "uniform",
        "device": "cpu",
        "progress-bar": False,
        "save-client-updates": False,
        "output-dir": str(output_dir),
        "run-name": RUN_NAME,
    }
