"""The real pretrained all-MiniLM-L6-v2 on real SNLI, federated with FLoRG through Flower."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_tools.flwr_cli import run_flower_app
from tests.harness.flower_harness import local_simulation_superlink

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHANCE = 1 / 3  # SNLI: entailment, neutral, contradiction (balanced)


def test_minilm_snli_learns_above_chance(tmp_path):
    settings = {
        "method": "florg",
        "model": "all-MiniLM-L6-v2",
        "task": "snli",
        "partitioner": "iid",
        "num-server-rounds": 3,
        "max-train-examples": 1600,
        "max-eval-examples": 600,
        "batch-size": 16,
        # SNLI pairs are short (MiniLM's tokens: median 24, 99th percentile 50, about 0.1 %
        # over 64): padding to 64 rather than the default 128 halves the compute, not the data.
        "max-seq-length": 64,
        "learning-rate": 0.001,
        "output-dir": str(tmp_path / "outputs"),
        "run-name": "minilm-snli",
        "progress-bar": False,
    }
    with local_simulation_superlink(tmp_path / "superlink", num_supernodes=2) as (home, conn):
        outcome = run_flower_app(ROOT, conn, settings, home, timeout=1200, stream=None)
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    rows = [json.loads(line) for line in (tmp_path / "outputs/minilm-snli/metrics.jsonl").open()]
    initial, final = rows[0]["accuracy"], rows[-1]["accuracy"]
    # 600 examples: one standard error of an accuracy near 1/3 is about 0.019.
    assert final > CHANCE + 0.05, rows
    assert final > initial, rows
