"""A SuperNode dies in the middle of a run (SIGKILL by pid while it trains in round 2).

The round ends without it once the SuperLink has marked it offline (missed heartbeats)
and goes on with the two others (min-train-nodes = 2); the server's log and metrics name
the lost node by the partition it reported in round 1. The node is restarted right away
(a new process, so a new node id); min-available-nodes = 3 makes round 3 wait for it,
and it takes part again.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from florg_tools.deploy.certs import generate_certificates
from florg_tools.flwr_cli import run_flower_app
from tests.harness.deploy_harness import ROOT, deployment, logs, rows, run_settings, tiny_assets

pytestmark = pytest.mark.integration

NODES = 3
VICTIM = 1
RECEIVED = re.compile(r"Receiving: train message")


def test_lost_supernode_is_named_and_rejoins_after_restart(tmp_path):
    model, task = tiny_assets(tmp_path)
    certs = generate_certificates(tmp_path / "certs")
    with deployment(tmp_path, certs, connection="node-loss") as dep:
        dep.start_superlink()
        for i in range(NODES):
            dep.start_supernode(i, NODES, wait=False)
        first_ids = dep.wait_registered()
        victim = dep.supernodes[VICTIM]
        events: dict[str, object] = {}

        def kill_in_round_two() -> None:
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline and not events.get("stop"):
                if len(RECEIVED.findall(victim.log_text())) >= 2:  # round 2's message arrived
                    events["survivors"] = victim.kill()
                    events["restarted"] = dep.start_supernode(VICTIM, NODES)
                    return
                time.sleep(0.2)

        killer = threading.Thread(target=kill_in_round_two, daemon=True)
        killer.start()
        out = tmp_path / "outputs"
        settings = run_settings(
            model,
            task,
            out,
            "node-loss",
            **{"num-server-rounds": 3, "min-train-nodes": 2, "min-available-nodes": 3},
        )
        try:
            outcome = run_flower_app(
                ROOT, dep.connection, settings, dep.flwr_home, timeout=480, stream=None
            )
        finally:
            events["stop"] = True
            killer.join(timeout=120)
        assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}\n{logs(dep)}"
        assert "restarted" in events, f"the victim never received round 2\n{logs(dep)}"
        assert events["survivors"] == [], events["survivors"]
        assert not victim.alive()
        new_id = dep.supernodes[VICTIM].info["node-id"]
        assert new_id != first_ids[VICTIM]
        assert dep.node_ids() == {**{n: i for i, n in first_ids.items()}, new_id: VICTIM}

    history = rows(out / "node-loss")
    assert [r["round"] for r in history] == [0, 1, 2, 3]
    assert history[1]["partitions"] == [0, 1, 2] and history[1]["lost-partitions"] == []
    assert history[2]["partitions"] == [0, 2] and history[2]["lost-partitions"] == [VICTIM]
    assert history[2]["clients"] == 2 and history[2]["lost-nodes"] == 1
    assert history[3]["partitions"] == [0, 1, 2] and history[3]["lost-partitions"] == []
    assert history[3]["clients"] == NODES
    assert f"round 2: lost node {first_ids[VICTIM]} (partition {VICTIM})" in outcome.log_text
    assert (out / "node-loss" / "adapter.safetensors").exists()
