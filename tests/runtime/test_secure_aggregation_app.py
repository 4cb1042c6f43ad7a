"""secure-aggregation=secaggplus end to end through the real simulation engine (SuperLink + Ray)
on the tiny BERT (tests/harness/flower_harness.py): FLoRG completes its rounds with every node
in the sum and the model a plain run of the same seed reaches, within the quantisation
(FedIT's pair: tests/deployment/test_secure_aggregation_deployed.py); a setting no sum can
serve (FedEx-LoRA's factored residual) is refused before launch. The round itself, method by
method, and a node lost after sharing its keys (through Flower's SecAgg+ mod over an
in-process grid): tests/runtime/test_secure_aggregation.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.harness.flower_harness import TINY_NUM_NODES, run_tiny_app

pytestmark = pytest.mark.integration

QUICK = {"local-steps": 2, "batch-size": 8, "max-test-examples": 0}
SECURE = {**QUICK, "secure-aggregation": "secaggplus", "screen-updates": False}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_arrays(run_dir: Path) -> dict[str, np.ndarray]:
    """The run's final global arrays (its last checkpoint's)."""
    files = sorted((run_dir / "checkpoint").glob("round-*/arrays.safetensors"))
    assert files, f"no checkpoint arrays under {run_dir}"
    return load_file(str(files[-1]))


@pytest.mark.parametrize("method", ["florg"])  # FedIT's pair: the deployment test (CI time)
def test_a_secure_run_reaches_the_plain_runs_model(tiny_superlink, tiny_assets, method):
    plain, plain_dir = run_tiny_app(
        tiny_superlink, tiny_assets, f"plain-{method}", method=method, **QUICK
    )
    assert plain.ok, f"{plain.message}\n{plain.log_text[-3000:]}"
    secure, secure_dir = run_tiny_app(
        tiny_superlink, tiny_assets, f"secure-{method}", method=method, **SECURE
    )
    assert secure.ok, f"{secure.message}\n{secure.log_text[-3000:]}"
    trained = [row for row in rows(secure_dir) if row["round"] > 0]
    assert [row["clients"] for row in trained] == [TINY_NUM_NODES] * 2
    assert all(row["secure-failed"] == 0 for row in trained)
    assert all(row["uplink-bytes"] > 0 for row in trained)
    got, want = final_arrays(secure_dir), final_arrays(plain_dir)
    shared = [key for key in want if key in got and got[key].shape == want[key].shape]
    assert shared
    for key in shared:  # two rounds of local training from states within ~1e-5 of each other
        np.testing.assert_allclose(got[key], want[key], atol=2e-3, rtol=0, err_msg=key)


def test_a_setting_that_cannot_be_a_sum_is_refused_before_launch(tiny_superlink, tiny_assets):
    outcome, run_dir = run_tiny_app(
        tiny_superlink, tiny_assets, "secure-fedex-factored",
        **{"method": "fedex-lora", "fedex-residual": "factored", **SECURE},
    )  # fmt: skip
    assert not outcome.ok
    assert "fedex-residual" in outcome.log_text and "secure aggregation" in outcome.log_text
    assert not run_dir.exists()
