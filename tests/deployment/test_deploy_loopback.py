"""Deployment on loopback through the documented commands (docs/deploy-superlink.md), real
Flower processes on free ports, TLS and SuperNode authentication, a full FLoRG run of the
tiny model:

1. ``python -m florg_tools.deploy.certs --out certs --node-keys 4``: CA, server cert, keys;
2. ``scripts/deploy_local.sh up --nodes 2 --num-partitions 3 --certs certs --node-auth``:
   the "server machine" -- a TLS SuperLink and the SuperNodes of partitions 0 and 1,
   their keys registered, the connection written into its FLWR_HOME;
3. ``flwr supernode register certs/node-keys/node-2.pub NAME``, then
   ``scripts/deploy_local.sh node --superlink ... --partition-id 2 --num-partitions 3
   --root-certificates certs/ca.crt --auth-key certs/node-keys/node-2 --data-path OWN
   --rank 1``: a "client machine" node training on its own data, at its own adapter rank
   (issue 30: the run's rank is 2; the node says it affords 1);
4. an unregistered key is refused; plain HTTP gets no answer;
5. ``scripts/deploy_local.sh connection --name ... --root-certificates certs/ca.crt`` and
   ``python -m florg_tools.launch --connection ...``: the run, checked to completion;
6. Ctrl-C (SIGINT by pid) to every command; none of the processes seen may survive.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import urllib.request

import numpy as np
import pytest

from florg_tools.flwr_cli import flwr_env
from florg_tools.superlink import find_free_port
from florg_tools.synthetic import make_sentiment_task
from tests.harness.deploy_harness import (
    CliProcesses,
    node_env,
    rows,
    run_settings,
    tiny_assets,
    wait_for_text,
)
from tests.harness.flower_harness import LeakedProcessesError

pytestmark = pytest.mark.integration

OWN_DATA_EXAMPLES = 60  # partition 2 trains on its own 60 examples, not an 80-example share
RUN_RANK, NODE_2_RANK = 2, 1  # run_settings' rank; node 2's --rank (its node-config rank=1)
SCRIPT = ["bash", "scripts/deploy_local.sh"]


def test_documented_commands_run_florg_over_tls_with_node_auth(tmp_path):
    model, task = tiny_assets(tmp_path)
    own_data = make_sentiment_task(tmp_path / "node2-data", n_train=OWN_DATA_EXAMPLES, seed=7)
    certs = tmp_path / "certs"
    env = flwr_env(tmp_path / "unused-home", extra=node_env(tmp_path))
    made = subprocess.run(
        [sys.executable, "-m", "florg_tools.deploy.certs", "--out", str(certs), "--san",
         "localhost", "--node-keys", "4"],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    port, home = find_free_port(), tmp_path / "home"
    procs = CliProcesses(tmp_path, env)
    failed = True
    try:
        up = procs.start(
            "up",
            [*SCRIPT, "up", "--nodes", "2", "--num-partitions", "3", "--certs", str(certs),
             "--node-auth", "--port", str(port), "--dir", str(tmp_path / "deploy"),
             "--flwr-home", str(home), "--connection", "loopback-tls",
             "--threads-per-node", "1"],
        )  # fmt: skip
        wait_for_text(up, "Ctrl-C stops everything.", timeout=300)
        conn = tomllib.loads((home / "config.toml").read_text())["superlink"]["loopback-tls"]
        assert conn == {"address": f"127.0.0.1:{port}", "root-certificates": str(certs / "ca.crt")}
        with pytest.raises(OSError):  # TLS only: plain HTTP gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)

        reg = subprocess.run(
            ["flwr", "supernode", "register", str(certs / "node-keys" / "node-2.pub"),
             "loopback-tls", "--format", "json"],
            env={**env, "FLWR_HOME": str(home)}, capture_output=True, text=True, check=False,
        )  # fmt: skip
        node_id = json.loads(reg.stdout[reg.stdout.index("{") :])["node-id"]
        node_args = [*SCRIPT, "node", "--superlink", f"127.0.0.1:{port}", "--num-partitions",
                     "3", "--root-certificates", str(certs / "ca.crt")]  # fmt: skip
        node = procs.start(
            "node-2",
            [*node_args, "--partition-id", "2", "--data-path", str(own_data), "--auth-key",
             str(certs / "node-keys" / "node-2"), "--runtime-port", str(find_free_port()),
             "--rank", str(NODE_2_RANK)],
        )  # fmt: skip
        assert f"SuperNode ID: {node_id}" in wait_for_text(node, "SuperNode ID:", timeout=120)
        refused = procs.start(
            "unregistered",
            [*node_args, "--partition-id", "1", "--auth-key", str(certs / "node-keys" / "node-3"),
             "--runtime-port", str(find_free_port())],
        )  # fmt: skip

        home2 = tmp_path / "cli-home"
        wrote = subprocess.run(
            [*SCRIPT, "connection", "--name", "lan", "--address", f"127.0.0.1:{port}",
             "--root-certificates", str(certs / "ca.crt"), "--flwr-home", str(home2)],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert wrote.returncode == 0, wrote.stderr
        out = tmp_path / "outputs"
        settings = run_settings(model, task, out, "loopback", **{"save-client-updates": True})
        sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
        launched = subprocess.run(
            [sys.executable, "-m", "florg_tools.launch", "--flwr-home", str(home2),
             "--connection", "lan", "--quiet", *sets],
            env=env, capture_output=True, text=True, check=False, timeout=480,
        )  # fmt: skip
        assert launched.returncode == 0, f"{launched.stderr[-3000:]}\n{procs.logs()}"
        assert re.search(r"OK: run \d+ finished:completed", launched.stderr)
        # The unregistered node, started before the run, was turned away meanwhile.
        assert refused.popen.wait(timeout=180) != 0
        assert "Failed to activate SuperNode" in refused.log_path.read_text()

        assert procs.interrupt(node) is not None and procs.interrupt(up) == 0
        failed = False
    finally:
        leaked = procs.stop_all()
        if leaked and not failed:
            raise LeakedProcessesError("processes survived Ctrl-C:\n" + "\n".join(leaked))

    history = rows(out / "loopback")
    assert [r["round"] for r in history] == [0, 1, 2]
    for r in history[1:]:
        assert r["partitions"] == [0, 1, 2] and r["lost-partitions"] == []
        assert r["clients"] == 3 and r["failures"] == 0
        # 240 training examples split IID over 3 partitions, but node 2 reads its own 60.
        assert r["examples"] == 80 + 80 + OWN_DATA_EXAMPLES
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in history)
    summary = json.loads((out / "loopback" / "summary.json").read_text())
    assert summary["final-accuracy"] == history[-1]["accuracy"] and summary["rounds"] == 2
    assert (out / "loopback" / "adapter.safetensors").stat().st_size > 0
    assert (out / "loopback" / "peft_lora" / "adapter_model.safetensors").exists()

    # Each node's adapter at its own rank (issue 30): node 2 (partition 2) trained and sent a
    # rank-1 A, the others rank-2 ones; the server's global state stays at the run's rank.
    assert settings["rank"] == RUN_RANK
    saved = np.load(out / "loopback" / "updates" / "round-2.npz")
    keys = [k[len("new/") :] for k in saved.files if k.startswith("new/") and k.endswith(".A")]
    assert keys
    partitions = [int(p) for p in saved["partitions"]]
    assert sorted(partitions) == [0, 1, 2]
    for key in keys:
        sent = {p: saved[f"client{i}/{key}"].shape[0] for i, p in enumerate(partitions)}
        assert sent == {0: RUN_RANK, 1: RUN_RANK, 2: NODE_2_RANK}, key
        assert saved[f"new/{key}"].shape[0] == RUN_RANK, key
    last = history[-1]
    assert last[f"clients_r{NODE_2_RANK}"] == 1 and last[f"clients_r{RUN_RANK}"] == 2
    assert last[f"up-params-r{NODE_2_RANK}"] < last[f"up-params-r{RUN_RANK}"]
