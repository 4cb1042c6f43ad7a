"""round-mode=async end to end through the real simulation engine (SuperLink + Ray), on the
tiny BERT (tests/harness/flower_harness.py): with every node in one buffer it is the
synchronous run, rows and adapter bit for bit; with a straggler the updates go on without
waiting for it; a killed run resumes, the replies in flight lost and counted; clients training
with DP-SGD (dp=example) stay within their target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from ci.behaviour_snapshot import is_wall_clock
from florg_tools.flwr_cli import run_flower_app
from florg_tools.run_config import resume_run_config
from flower_app.client.node_state import NODE_STATE_ENV
from tests.harness.flower_harness import TINY_NUM_NODES, run_tiny_app
from tests.harness.ray_harness import shared_ray_simulation_superlink

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

# What only an asynchronous row holds (strategies/server/buffered_rounds.py)
ASYNC_KEYS = {"version", "staleness", "staleness-mean", "staleness-max", "in-flight",
              "stale-rejected"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_superlink(tiny_assets):
    """conftest's, with one ClientApp actor per node: a straggler sleeping in its actor
    must not hold the other nodes' tasks back, as it holds no other SuperNode back in a
    deployment."""
    base = tiny_assets[2]
    with shared_ray_simulation_superlink(
        base / "superlink",
        num_supernodes=TINY_NUM_NODES,
        extra_env={NODE_STATE_ENV: str(base / "node-state")},
        actors=TINY_NUM_NODES,
    ) as sim:
        yield sim


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# FLoRG's Gram-delta rule; FedIT's mean rule runs async in the tests below and on real
# SuperNodes (tests/deployment/test_deploy_async.py), its update on random inputs in
# tests/runtime/test_buffered_update.py
@pytest.mark.parametrize("method", ["florg"])
def test_one_buffer_of_every_node_is_the_synchronous_run(tiny_superlink, tiny_assets, method):
    """async-concurrency = async-buffer-size = every node: each update's replies all trained
    from the current model, so each is the synchronous round (the strategy's own step)."""
    sync, sync_dir = run_tiny_app(tiny_superlink, tiny_assets, f"sync-{method}", method=method)
    assert sync.ok, sync.message
    buffered, async_dir = run_tiny_app(
        tiny_superlink, tiny_assets, f"async-{method}", method=method, **{"round-mode": "async"}
    )
    assert buffered.ok, f"{buffered.message}\n{buffered.log_text[-3000:]}"
    sync_rows, async_rows = rows(sync_dir), rows(async_dir)
    assert len(async_rows) == len(sync_rows) == 3  # round 0 and two updates
    for before, after in zip(sync_rows, async_rows, strict=True):
        assert {k: v for k, v in after.items() if k not in ASYNC_KEYS and not is_wall_clock(k)} == {
            k: v for k, v in before.items() if not is_wall_clock(k)
        }
    for row in async_rows[1:]:
        assert row["version"] == row["round"] and row["staleness"] == [0] * TINY_NUM_NODES
    a, b = (load_file(str(d / "adapter.safetensors")) for d in (sync_dir, async_dir))
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_a_straggler_does_not_hold_the_updates_back(tiny_superlink, tiny_assets):
    """Partition 0 waits 15 s before each reply (``slow-delay``; a fast node's task takes
    about 0.3 s once its actor is up); with two replies an update, the two fast nodes carry
    the run's four updates (a reply of partition 0 that lands in time is applied with its
    staleness; which update it lands in depends on the machine)."""
    outcome, run_dir = run_tiny_app(
        tiny_superlink,
        tiny_assets,
        "async-straggler",
        method="florg",
        **{"round-mode": "async", "async-buffer-size": 2, "num-server-rounds": 4,
           "slow-partitions": "0", "slow-delay": 15.0},
    )  # fmt: skip
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}"
    updates = rows(run_dir)[1:]
    assert [row["version"] for row in updates] == [1, 2, 3, 4]
    assert sum(0 in row["partitions"] for row in updates) <= 1
    for row in updates:
        assert len(row["partitions"]) == len(row["staleness"]) == 2
        assert row["staleness-max"] == max(row["staleness"])
        assert 0 <= row["staleness-max"] <= row["version"] - 1


def test_a_killed_async_run_resumes_and_counts_the_replies_in_flight_as_lost(
    tiny_superlink, tiny_assets
):
    """The ServerApp dies right after checkpointing update 2 (``fault-server-round``) while
    the straggler's task is in flight; the resumed run continues at update 3, counts that
    reply as lost (``lost-in-flight``, from the checkpoint) and never applies it."""
    settings = {"round-mode": "async", "async-buffer-size": 2, "num-server-rounds": 4,
                "slow-partitions": "0", "slow-delay": 15.0}  # fmt: skip
    crashed, run_dir = run_tiny_app(
        tiny_superlink, tiny_assets, "async-crash", method="fedit",
        **settings, **{"fault-server-round": 2},
    )  # fmt: skip
    assert not crashed.ok and "fault-server-round" in crashed.log_text
    state = json.loads((run_dir / "checkpoint" / "round-000002" / "state.json").read_text())
    saved = state["strategy"]["async"]
    in_flight = saved["in-flight"]
    assert in_flight >= 1  # the straggler's task at least
    before = rows(run_dir)
    home, connection = tiny_superlink
    resumed = run_flower_app(
        ROOT, connection, resume_run_config(run_dir), home, timeout=600, stream=None
    )
    assert resumed.ok, f"{resumed.message}\n{resumed.log_text[-3000:]}"
    history = rows(run_dir)
    assert [r["round"] for r in history] == [0, 1, 2, 3, 4]  # none twice, none skipped
    assert history[:3] == before
    assert [r["version"] for r in history[1:]] == [1, 2, 3, 4]
    lost = in_flight + saved["buffered"]  # and the replies received beyond the buffer
    assert history[3]["lost-in-flight"] == lost and "lost-in-flight" not in history[4]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed-after-round"] == 2


def test_dp_sgd_clients_train_async_within_their_target(tiny_superlink, tiny_assets):
    """dp=example with a straggler: each client's noise is calibrated for num-server-rounds
    rounds and a node trains at most once from each version, so no client's epsilon passes
    the target, and every update's row carries the clients' record."""
    outcome, run_dir = run_tiny_app(
        tiny_superlink,
        tiny_assets,
        "async-dp-sgd",
        method="florg",
        **{"round-mode": "async", "async-buffer-size": 2, "num-server-rounds": 3,
           "slow-partitions": "0", "slowdown": 3.0, "dp": "example",
           "dp-sgd-target-epsilon": 8.0, "dp-sgd-clipping-norm": 1.0,
           "dp-sgd-seeded-noise": True, "batch-size": 8, "local-steps": 2,
           "max-test-examples": 0},
    )  # fmt: skip
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}"
    updates = rows(run_dir)[1:]
    assert [row["version"] for row in updates] == [1, 2, 3]
    for row in updates:
        assert 0 < row["dp-sgd-epsilon-max"] <= 8.0 and row["dp-sgd-over-target"] == 0
        assert 0 <= row["dp-sgd-clipped-fraction"] <= 1
