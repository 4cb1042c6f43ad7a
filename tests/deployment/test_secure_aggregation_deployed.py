"""secure-aggregation=secaggplus across real processes: a TLS SuperLink and 3 SuperNodes
(each its own process, a ClientApp process per message, as on separate machines) run FedIT
for 2 secure rounds of the tiny BERT (``METHODS``; FLoRG passed too, at twice the time).
Every round sums all 3 nodes (none failed, none dropped), so each node's SecAgg+ keys, kept
in its ``Context.state``, lived from setup to unmask across the ClientApp processes of one
round; the final model equals a plain run's of the same settings on the same deployment
within the quantisation. One deployment serves the module; its runs go at once
(simulation: tests/runtime/test_secure_aggregation_app.py).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from florg_tools.deploy.certs import generate_certificates
from florg_tools.flwr_cli import run_flower_app
from tests.harness.deploy_harness import ROOT, deployment, logs, rows, run_settings, tiny_assets

pytestmark = pytest.mark.integration

NODES, ROUNDS = 3, 2
METHODS = ("fedit",)  # FLoRG's secure step: the simulation test (CI time: 524 s with both)
STAGES = 4  # SecAgg+'s setup, share keys, collect masked vectors (training inside), unmask
QUICK = {"num-server-rounds": ROUNDS, "local-steps": 2, "client-eval": "off",
         "progress-bar": False}  # fmt: skip
SECURE = {"secure-aggregation": "secaggplus"}
RECEIVED = re.compile(r"Receiving: train message")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """{run name: its folder} of a plain and a secure run of each method, all four at once
    on one TLS deployment: a round's time is mostly Flower's polling and each message's
    ClientApp process starting, which the runs overlap."""
    base = tmp_path_factory.mktemp("secure-deployed")
    model, task = tiny_assets(base)
    certs = generate_certificates(base / "certs")
    out = base / "outputs"
    runs = {f"{kind}-{method}": {"method": method, **(SECURE if kind == "secure" else {})}
            for method in METHODS for kind in ("plain", "secure")}  # fmt: skip
    with deployment(base, certs, connection="secure-tls") as dep:
        dep.start_superlink()
        for i in range(NODES):
            dep.start_supernode(i, NODES, wait=False)
        assert sorted(dep.wait_registered()) == list(range(NODES))

        def run(name: str):
            settings = run_settings(model, task, out, name, **QUICK, **runs[name])
            t0 = time.monotonic()
            outcome = run_flower_app(ROOT, dep.connection, settings, dep.flwr_home,
                                     timeout=600, stream=None)  # fmt: skip
            print(f"{name}: {time.monotonic() - t0:.1f} s")
            return outcome

        with ThreadPoolExecutor(len(runs)) as pool:
            outcomes = dict(zip(runs, pool.map(run, runs), strict=True))
        failed = [f"{name}: {o.message}\n{o.log_text[-3000:]}" for name, o in outcomes.items()
                  if not o.ok]  # fmt: skip
        assert not failed, "\n".join(failed) + f"\n{logs(dep)}"
        # Each node received every message of every run: one a plain round, four a secure one.
        received = [len(RECEIVED.findall(node.log_text())) for node in dep.supernodes.values()]
        assert received == [ROUNDS * (1 + STAGES) * len(METHODS)] * NODES, received
    # the deployment is stopped (with its leak check) before the tests read the folders
    return {name: out / name for name in runs}


def _final_arrays(run_dir: Path) -> dict[str, np.ndarray]:
    """The run's final global arrays (its last checkpoint's)."""
    files = sorted((run_dir / "checkpoint").glob("round-*/arrays.safetensors"))
    assert files, f"no checkpoint arrays under {run_dir}"
    return load_file(str(files[-1]))


@pytest.mark.parametrize("method", METHODS)
def test_secure_rounds_over_tls_reach_the_plain_runs_model(finished, method):
    secure_dir = finished[f"secure-{method}"]
    history = rows(secure_dir)
    assert [r["round"] for r in history] == list(range(ROUNDS + 1))
    for r in history[1:]:
        assert r["clients"] == NODES and r["partitions"] == list(range(NODES))
        assert r["secure-failed"] == 0 and r["secure-dropped-after-keys"] == 0
        assert r["uplink-bytes"] > 0 and np.isfinite(r["train-loss"])
    got, want = _final_arrays(secure_dir), _final_arrays(finished[f"plain-{method}"])
    shared = [key for key in want if key in got and got[key].shape == want[key].shape]
    assert shared
    for key in shared:  # two rounds of local training from states within ~1e-5 of each other
        np.testing.assert_allclose(got[key], want[key], atol=2e-3, rtol=0, err_msg=key)
