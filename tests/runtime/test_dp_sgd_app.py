"""``dp=example`` (DP-SGD on every client, docs/privacy.md section 9) through the Flower
simulation: the tiny BERT, 3 SuperNodes, 2 rounds, FLoRG and FedIT; Fed-SB, whose round 0
is a private release composed into each client's ledger; then a client past
``dp-max-epsilon`` refusing a round. One SuperLink on one Ray cluster serves the module's
runs (conftest.py's ``tiny_superlink``, tests/harness/ray_harness.py), the nodes keep their ledgers
on disk (``$FLORG_NODE_STATE_DIR``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flower_app.client.dp_state import FILE
from flower_app.privacy.dp_sgd import ClientAccountant
from tests.harness.flower_harness import TINY_NUM_NODES, run_tiny_app

pytestmark = pytest.mark.integration

NUM_NODES = TINY_NUM_NODES
# This module's settings on top of the tiny app's (run_tiny_app): small batches, two local
# steps a round (a client's ledger after the run: two rounds of two steps), no test split.
SMALL = {"batch-size": 8, "local-steps": 2, "max-test-examples": 0, "max-eval-examples": 40}
# The command: --set dp=example (z and C given), two rounds, reproducible noise.
DP = {
    "dp": "example",
    "dp-sgd-noise-multiplier": 1.0,
    "dp-sgd-clipping-norm": 1.0,
    "dp-sgd-seeded-noise": True,
}


def run(tiny_superlink, tiny_assets, name: str, **settings):
    """A run of this module (``run_tiny_app`` with DP-SGD and ``SMALL`` on top): its outcome,
    metrics rows and folder."""
    outcome, run_dir = run_tiny_app(
        tiny_superlink, tiny_assets, name, **{**SMALL, **DP, **settings}
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return outcome, rows, run_dir


@pytest.fixture(scope="module")
def made(tiny_superlink, tiny_assets) -> dict:
    """The module's runs by name, each made once (the refusal test reuses FedIT's)."""
    return {}


def run_once(made: dict, tiny_superlink, tiny_assets, method: str):
    name = f"dp-sgd-{method}"
    if name not in made:
        made[name] = run(tiny_superlink, tiny_assets, name, method=method)
    return made[name]


def node_ledgers(base: Path) -> list[ClientAccountant]:
    return [
        ClientAccountant.from_state_dict(json.loads(path.read_text()))
        for path in sorted((base / "node-state").glob(f"*/partition-*/{FILE}"))
    ]


@pytest.mark.parametrize("method", ["florg", "fedit"])
def test_two_rounds_with_dp_sgd_report_epsilon_in_every_row(
    tiny_superlink, tiny_assets, made, method
):
    outcome, rows, run_dir = run_once(made, tiny_superlink, tiny_assets, method)
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    assert [r["round"] for r in rows] == [0, 1, 2]
    epsilons = [r["dp-sgd-epsilon-max"] for r in rows]
    assert epsilons[0] == 0 < epsilons[1] < epsilons[2]
    for row in rows[1:]:
        assert row["dp-sgd-clients"] == NUM_NODES and row["failures"] == 0
        assert row["dp-sgd-over-target"] == 0  # no target set
        # what the clients' DP-SGD did (strategies/server/example_dp.py): z C / B with
        # z = C = 1 and B = the batch size (each partition holds more than 8 examples)
        assert 0 <= row["dp-sgd-clipped-fraction"] <= 1
        assert row["dp-sgd-grad-norm-median"] > 0 and row["dp-sgd-clipped-mean-norm"] > 0
        assert row["dp-sgd-noise-std"] == pytest.approx(1.0 / SMALL["batch-size"])
        assert row["dp-sgd-noise-norm"] > row["dp-sgd-noise-std"]
    assert not any(key.startswith("dp-sgd-noise") for key in rows[0])  # nothing trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dp-sgd-epsilon-max"] == epsilons[2]
    assert summary["dp-sgd-clipped-fraction"] == rows[2]["dp-sgd-clipped-fraction"]
    assert f"dp-sgd epsilon max {epsilons[2]:.4g}" in outcome.log_text
    # the largest ledger the nodes wrote is the row's: two rounds of two steps each
    ledgers = [
        ledger for ledger in node_ledgers(tiny_assets[2]) if ledger.ledger.steps == 4
    ]  # this run's and the other method's, same data and settings
    assert ledgers and max(ledger.epsilon() for ledger in ledgers) == pytest.approx(epsilons[2])


def test_fed_sb_composes_round_0_into_every_clients_epsilon(tiny_superlink, tiny_assets, made):
    """Fed-SB under dp=example: round 0's private gradient estimates put each client's
    epsilon above 0 in row 0 (and the log), every training row continues from there, and
    each node's ledger on disk starts with round 0's release (z0, q0 = N / n, 1) before
    its two training rounds (the query carries the run's lineage: the node-state folder).
    Its clients withhold their unnoised metrics (``dp-unnoised-metrics=withhold``): no row
    has a train loss or a data-dependent DP-SGD statistic, the noise's report stays."""
    outcome, rows, _ = run(
        tiny_superlink,
        tiny_assets,
        "dp-sgd-fed-sb",
        method="fed-sb",
        **{"fed-sb-init-examples": 12, "dp-unnoised-metrics": "withhold"},
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    assert [r["round"] for r in rows] == [0, 1, 2]
    epsilons = [r["dp-sgd-epsilon-max"] for r in rows]
    assert all(math.isfinite(e) for e in epsilons) and 0 < epsilons[0] < epsilons[1] < epsilons[2]
    assert rows[0]["dp-sgd-clients"] == NUM_NODES and rows[0]["failures"] == 0
    for row in rows[1:]:
        assert row["dp-sgd-clients"] == NUM_NODES and row["failures"] == 0
        assert row["dp-sgd-noise-std"] == pytest.approx(1.0 / SMALL["batch-size"])
        withheld = {"train-loss", "client-train-seconds", "dp-sgd-clipped-fraction",
                    "dp-sgd-grad-norm-median", "dp-sgd-clipped-mean-norm"}  # fmt: skip
        assert not withheld & set(row), withheld & set(row)
    assert f"round 0: dp-sgd epsilon max {epsilons[0]:.4g}" in outcome.log_text
    # this run's ledgers: 1 release + 2 rounds of 2 steps (the other methods' hold 4 steps);
    # round 0's (z0 = 1.0, the default; q0 = 12 / n, not the training rounds' 8 / n) first
    ledgers = [a.ledger.compositions for a in node_ledgers(tiny_assets[2]) if a.ledger.steps == 5]
    assert len(ledgers) == NUM_NODES
    for compositions in ledgers:
        z0, q0, count = compositions[0]
        assert (z0, count) == (1.0, 1) and 0 < q0 < 1
        assert [c[2] for c in compositions[1:]] == [4] and compositions[1][1] < q0


def test_a_client_past_dp_max_epsilon_refuses_and_the_round_goes_on(
    tiny_superlink, tiny_assets, made
):
    """The limit between the first round's largest epsilon and the second's: round 1 trains
    everywhere, in round 2 the client(s) that would pass it refuse (failed replies, logged
    with the reason) and the others' updates are aggregated."""
    _, clean, _ = run_once(made, tiny_superlink, tiny_assets, "fedit")
    limit = (clean[1]["dp-sgd-epsilon-max"] + clean[2]["dp-sgd-epsilon-max"]) / 2
    outcome, rows, _ = run(
        tiny_superlink, tiny_assets, "dp-sgd-limit", method="fedit", **{"dp-max-epsilon": limit}
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    assert rows[1]["failures"] == 0 and rows[2]["failures"] >= 1
    assert rows[2]["dp-sgd-epsilon-max"] <= limit
    assert rows[2]["clients"] == NUM_NODES - rows[2]["failures"]
    assert "refuses to train" in outcome.log_text
