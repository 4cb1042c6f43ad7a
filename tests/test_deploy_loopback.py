"""Deployment on loopback: a TLS SuperLink with SuperNode authentication and three
SuperNodes (real Flower processes on free ports), a full FLoRG run of the tiny model.

Checks the run's outputs, that TLS and node authentication are enforced (plain HTTP and
an unregistered key are refused), that a node-config ``data-path`` makes a node train on
its own data, and that every process is stopped by pid with none left alive.
"""

from __future__ import annotations

import json
import tomllib
import urllib.request

import pytest

from flower_app.deploy.certs import generate_certificates, generate_node_keys
from flower_app.deploy.processes import register_node
from flower_app.launch import LaunchError, run_flower_app
from tests.deploy_harness import ROOT, deployment, logs, rows, run_settings, tiny_assets
from tests.fixtures import make_sentiment_task

NODES = 3
OWN_DATA_EXAMPLES = 60  # node 2 trains on its own 60 examples instead of its 80-example share


def test_tls_deployment_with_node_auth_runs_florg(tmp_path):
    model, task = tiny_assets(tmp_path)
    own_data = make_sentiment_task(tmp_path / "node2-data", n_train=OWN_DATA_EXAMPLES, seed=7)
    certs = generate_certificates(tmp_path / "certs")
    keys = generate_node_keys(tmp_path / "node-keys", NODES + 1)
    with deployment(tmp_path, certs, node_auth=True, connection="loopback-tls") as dep:
        dep.start_superlink()
        assert "--insecure" not in dep.superlink.argv
        with pytest.raises(OSError):  # TLS only: plain HTTP gets no answer
            urllib.request.urlopen(f"http://{dep.address}/health", timeout=5)
        conn = tomllib.loads((dep.flwr_home / "config.toml").read_text())["superlink"]
        assert conn["loopback-tls"] == {
            "address": dep.address,
            "root-certificates": str(certs.ca_cert),
        }

        registered = {
            i: register_node(dep.flwr_home, dep.connection, keys[i].public_key)
            for i in range(NODES)
        }
        for i in range(NODES):
            dep.start_supernode(i, NODES, auth_key=keys[i], data_path=own_data if i == 2 else None)
        assert dep.node_ids() == {node: i for i, node in registered.items()}
        # A key nobody registered is turned away (Flower exits with code 305).
        with pytest.raises(LaunchError, match="Failed to activate SuperNode"):
            dep.start_supernode(0 + NODES, NODES + 1, auth_key=keys[NODES], timeout=60)

        out = tmp_path / "outputs"
        outcome = run_flower_app(
            ROOT,
            dep.connection,
            run_settings(model, task, out, "loopback"),
            dep.flwr_home,
            timeout=420,
            stream=None,
        )
        assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}\n{logs(dep)}"

    history = rows(out / "loopback")
    assert [r["round"] for r in history] == [0, 1, 2]
    for r in history[1:]:
        assert r["partitions"] == [0, 1, 2] and r["lost-partitions"] == []
        assert r["clients"] == NODES and r["failures"] == 0
        # 240 training examples split IID over 3 partitions, but node 2 reads its own 60.
        assert r["examples"] == 80 + 80 + OWN_DATA_EXAMPLES
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in history)
    summary = json.loads((out / "loopback" / "summary.json").read_text())
    assert summary["final-accuracy"] == history[-1]["accuracy"]
    assert summary["rounds"] == 2
    assert (out / "loopback" / "adapter.safetensors").stat().st_size > 0
    assert (out / "loopback" / "peft_lora" / "adapter_model.safetensors").exists()
