"""round-mode=async on real SuperNodes (SuperLink and three SuperNodes on loopback), one of
them a straggler by its own node-config (``slowdown``): the updates go on with the two
others, as in the simulation (tests/runtime/test_async_rounds.py), outside it: FLoRG (the
Gram rule) and FedIT (the mean rule)."""

from __future__ import annotations

import json

import pytest

from florg_tools.flwr_cli import run_flower_app
from tests.harness.deploy_harness import ROOT, deployment, logs, rows, run_settings, tiny_assets

pytestmark = pytest.mark.integration

NODES = 3
SLOW = 1


@pytest.mark.parametrize("method", ["florg", "fedit"])  # the Gram rule and the mean rule
def test_async_updates_on_real_supernodes_do_not_wait_for_the_slowed_one(tmp_path, method):
    model, task = tiny_assets(tmp_path)
    out = tmp_path / "outputs"
    with deployment(tmp_path, None, connection="async") as dep:
        dep.start_superlink()
        for i in range(NODES):
            slowdown = {"slowdown": 1000.0} if i == SLOW else None
            dep.start_supernode(i, NODES, wait=False, node_config=slowdown)
        dep.wait_registered()
        settings = run_settings(
            model, task, out, "async",
            **{"method": method, "round-mode": "async", "async-buffer-size": 2,
               "num-server-rounds": 3},
        )  # fmt: skip
        outcome = run_flower_app(
            ROOT, dep.connection, settings, dep.flwr_home, timeout=480, stream=None
        )
        assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}\n{logs(dep)}"
    updates = rows(out / "async")[1:]
    assert [row["version"] for row in updates] == [1, 2, 3]
    assert sum(SLOW in row["partitions"] for row in updates) <= 1
    assert all(len(row["partitions"]) == 2 for row in updates)
    assert json.loads((out / "async" / "config.json").read_text())["method"] == method
