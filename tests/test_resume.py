"""Issue 15, item 1: a ServerApp that dies after a round is resumed from its checkpoint:
no round is run twice or skipped, metrics.jsonl continues, and the final adapter equals
the uninterrupted run's (the tiny model trains deterministically).

Real Flower simulation runs on one private SuperLink (3 nodes): a clean run, a run whose
ServerApp dies right after checkpointing round 1 (``fault-server-round=1``: the run ends
``finished:failed``), and its resumption with the launcher's settings
(``resume_run_config``: the run folder's config.json plus ``resume=RUN_DIR``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from client_app.client_app import NODE_STATE_ENV
from florg_tools.flwr_cli import run_flower_app
from florg_tools.run_config import resume_run_config
from tests.ray_harness import shared_ray_simulation_superlink

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
NODES = 3
ROUNDS = 3


@pytest.fixture(scope="module")
def assets(tiny_bert_dir, sentiment_task_dir, tmp_path_factory):
    return tiny_bert_dir, sentiment_task_dir, tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def superlink(assets):
    _, _, base = assets
    env = {NODE_STATE_ENV: str(base / "node-state")}
    # One Ray cluster for the module's runs (tests/ray_harness.py says why).
    with shared_ray_simulation_superlink(base / "superlink", NODES, extra_env=env) as sim:
        yield sim


def run(superlink, config):
    home, connection = superlink
    return run_flower_app(ROOT, connection, config, home, timeout=600, stream=None)


def settings(assets, name: str, method: str, **extra) -> dict:
    model, task, base = assets
    return {
        "method": method,
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "text-fields": "sentence",
        "rank": 2,
        "num-server-rounds": ROUNDS,
        "min-available-nodes": NODES,
        "batch-size": 16,
        "learning-rate": 0.01,
        "output-dir": str(base / "outputs"),
        "run-name": name,
        **extra,
    }


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# The methods whose resumption carries state beyond the strategy's own (a unit test,
# tests/test_checkpoint.py, restores every strategy's state exactly): FedSA-LoRA's per-node
# B on the nodes' disks, FedEx-LoRA's residuals re-sent to every client after a restart.
# FLoRG's end-to-end resumption runs in tests/test_deploy_faults.py (ServerApp killed,
# SuperLink restarted; final adapter equal to the clean run's), so it is not repeated here
# (each case is three Flower runs, about three minutes of CI).
@pytest.mark.parametrize("method", ["fedsa-lora", "fedex-lora"])
def test_a_server_that_dies_after_round_1_resumes_to_the_clean_result(superlink, assets, method):
    base = assets[2]
    clean = run(superlink, settings(assets, f"clean-{method}", method))
    assert clean.ok, f"{clean.message}\n{clean.log_text[-3000:]}"
    crash_dir = base / "outputs" / f"crash-{method}"
    crashed = run(superlink, settings(assets, crash_dir.name, method, **{"fault-server-round": 1}))
    assert not crashed.ok and "fault-server-round" in crashed.log_text
    assert [r["round"] for r in rows(crash_dir)] == [0, 1]
    assert (crash_dir / "checkpoint" / "round-000001" / "state.json").is_file()
    assert not (crash_dir / "adapter.safetensors").exists()
    before = rows(crash_dir)

    resumed = run(superlink, resume_run_config(crash_dir))
    assert resumed.ok, f"{resumed.message}\n{resumed.log_text[-3000:]}"
    assert "resuming" in resumed.log_text and "after round 1" in resumed.log_text
    history = rows(crash_dir)
    assert [r["round"] for r in history] == list(range(ROUNDS + 1))  # none twice, none skipped
    assert history[:2] == before  # the rows of the first process are kept as they were
    reference = rows(base / "outputs" / f"clean-{method}")
    for ours, theirs in zip(history, reference, strict=True):
        assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-9), ours["round"]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), ours["round"]
        assert ours["up-params"] == theirs["up-params"]
        if method == "fedsa-lora" and ours["round"] > 0:  # the nodes' B came back from disk
            assert ours.get("personalized-loss") == pytest.approx(
                theirs.get("personalized-loss"), rel=1e-5
            )
    assert history[-1]["cum-up-params"] == reference[-1]["cum-up-params"]
    final = load_file(str(crash_dir / "adapter.safetensors"))
    expected = load_file(str(base / "outputs" / f"clean-{method}" / "adapter.safetensors"))
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(final[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    summary = json.loads((crash_dir / "summary.json").read_text())
    assert (
        summary["resumed-after-round"] == 1 and summary["final-accuracy"] == history[-1]["accuracy"]
    )


def test_a_dp_run_resumed_after_round_1_continues_the_privacy_count(superlink, assets):
    """dp=central: the accountant's ledger is in the checkpoint, so the resumed run's epsilon
    after rounds 2 and 3 is that of 2 and 3 rounds, not of 1 and 2 (issue 29)."""
    from strategies.dp import epsilon_for

    dp = {"dp": "central", "dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0, "dp-delta": 1e-4}
    crash_dir = assets[2] / "outputs" / "crash-dp"
    crashed = run(
        superlink, settings(assets, crash_dir.name, "fedit", **dp, **{"fault-server-round": 1})
    )
    assert not crashed.ok and "fault-server-round" in crashed.log_text
    state = json.loads((crash_dir / "checkpoint" / "round-000001" / "state.json").read_text())
    assert state["strategy"]["dp"] == {"delta": 1e-4, "compositions": [[1.0, 1.0, 1]]}

    resumed = run(superlink, resume_run_config(crash_dir))
    assert resumed.ok, f"{resumed.message}\n{resumed.log_text[-3000:]}"
    history = rows(crash_dir)
    assert [r["round"] for r in history] == list(range(ROUNDS + 1))
    expected = [0.0] + [epsilon_for(1.0, 1.0, t, 1e-4) for t in range(1, ROUNDS + 1)]
    assert [r["dp-epsilon"] for r in history] == pytest.approx(expected, rel=1e-9)
    summary = json.loads((crash_dir / "summary.json").read_text())
    assert (
        summary["resumed-after-round"] == 1 and summary["dp-epsilon"] == history[-1]["dp-epsilon"]
    )
