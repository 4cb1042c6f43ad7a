"""Strategies' reply handling on hand-built Flower messages (no simulation needed)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.wire.records import from_array_record, to_array_record
from strategies.florg.rule import aggregate_florg
from tests.harness.strategy_helpers import strategy_for

# Messages are normally built inside a run; give this process a run identity.
TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

rng = np.random.default_rng(0)
PREV = {"enc.q.A": rng.standard_normal((2, 6)), "classifier.weight": rng.standard_normal((3, 6))}


def reply(arrays, **metrics) -> Message:
    content = RecordDict(
        {
            "arrays": to_array_record(arrays),
            "metrics": MetricRecord({"num-examples": 10, "train-loss": 1.0, **metrics}),
        }
    )
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def client_state(scale=0.1):
    return {k: v + scale * rng.standard_normal(v.shape) for k, v in PREV.items()}


def test_florg_aggregates_like_the_core_and_fedavgs_the_head():
    strategy = strategy_for("florg", PREV, fingerprint=7)
    clients = [client_state() for _ in range(3)]
    arrays, metrics = strategy.aggregate_train(
        1, [reply(c, **{"lr-fingerprint": 7}) for c in clients]
    )
    new = from_array_record(arrays)
    As = [c["enc.q.A"].astype(np.float32) for c in clients]
    expected, info = aggregate_florg(As, None, PREV["enc.q.A"])
    np.testing.assert_allclose(new["enc.q.A"], expected, rtol=1e-6)
    head = np.mean([c["classifier.weight"].astype(np.float32) for c in clients], axis=0)
    np.testing.assert_allclose(new["classifier.weight"], head, rtol=1e-6)
    assert metrics["clients"] == 3 and metrics["rank"] == info["rank"]


@pytest.mark.parametrize("rank_mismatch", ["procrustes", "truncate"])
def test_florg_strategy_passes_device_and_rank_policy(rank_mismatch):
    state = {**PREV, "enc.v.A": rng.standard_normal((2, 6))}
    strategy = strategy_for("florg", state, server_device="cpu", rank_mismatch=rank_mismatch)
    assert strategy.server_device.type == "cpu" and strategy.rank_mismatch == rank_mismatch
    clients = [{k: v + 0.5 * rng.standard_normal(v.shape) for k, v in state.items()}]
    clients.append({k: rng.standard_normal(v.shape) for k, v in state.items()})
    arrays, metrics = strategy.aggregate_train(1, [reply(c) for c in clients])
    new = from_array_record(arrays)
    for key in ("enc.q.A", "enc.v.A"):
        As = [c[key].astype(np.float32) for c in clients]
        expected, info = aggregate_florg(As, None, state[key], rank_mismatch=rank_mismatch)
        np.testing.assert_allclose(new[key], expected, rtol=1e-6)
        assert info["rank"] == 4 > 2  # r' > r: the policies differ here
    other = "truncate" if rank_mismatch == "procrustes" else "procrustes"
    differ, _ = aggregate_florg(
        [c["enc.q.A"].astype(np.float32) for c in clients], None, state["enc.q.A"],
        rank_mismatch=other,
    )  # fmt: skip
    assert np.linalg.norm(new["enc.q.A"] - differ) > 1e-3
    assert metrics["rank"] == 4
    with pytest.raises(ValueError, match="rank-mismatch"):
        strategy_for("florg", state, rank_mismatch="svd")
    from flower_app.methods.registry import get_method
    from strategies.florg.strategy import FLoRGStrategy

    with pytest.raises(ValueError, match="rank_mismatch"):
        FLoRGStrategy(state, method=get_method("florg"), rank_mismatch="svd")
    # The FLoRG keys are ignored by the other methods.
    strategy_for("fedit", {"l.lora_A": np.ones((2, 3))}, server_device="cpu")


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: {**s, "enc.q.A": np.full((2, 6), np.nan)},
        lambda s: {**s, "enc.q.A": np.zeros((2, 5))},
        lambda s: {k: v for k, v in s.items() if k != "classifier.weight"},
    ],
)
def test_bad_replies_are_rejected_not_aggregated(bad):
    strategy = strategy_for("florg", PREV)
    good = client_state()
    arrays, metrics = strategy.aggregate_train(1, [reply(good), reply(bad(client_state()))])
    assert metrics["rejected"] == 1 and metrics["clients"] == 1
    expected, _ = aggregate_florg([good["enc.q.A"].astype(np.float32)], None, PREV["enc.q.A"])
    np.testing.assert_allclose(from_array_record(arrays)["enc.q.A"], expected, rtol=1e-6)


def test_florg_rejects_a_client_with_other_projections():
    strategy = strategy_for("florg", PREV, fingerprint=0xABC)
    _, metrics = strategy.aggregate_train(
        1, [reply(client_state(), **{"lr-fingerprint": 0xABC}),
            reply(client_state(), **{"lr-fingerprint": 0xDEF})]
    )  # fmt: skip
    assert metrics["rejected"] == 1 and metrics["clients"] == 1


def test_no_valid_reply_keeps_the_global_model():
    strategy = strategy_for("fedit", {"l.lora_A": np.ones((2, 3)), "l.lora_B": np.ones((3, 2))})
    arrays, metrics = strategy.aggregate_train(1, [reply({"l.lora_A": np.ones((2, 3))})])
    assert arrays is None and metrics["rejected"] == 1
    np.testing.assert_array_equal(strategy.global_state["l.lora_A"], np.ones((2, 3)))


def test_num_examples_weighting():
    state = {"l.lora_A": np.zeros((1, 2)), "l.lora_B": np.zeros((2, 1))}
    strategy = strategy_for("fedit", state, aggregation_weights="num-examples")
    a = {"l.lora_A": np.ones((1, 2)), "l.lora_B": np.ones((2, 1))}
    b = {"l.lora_A": 3 * np.ones((1, 2)), "l.lora_B": 3 * np.ones((2, 1))}
    r1, r2 = reply(a), reply(b)
    r2.content["metrics"]["num-examples"] = 30
    arrays, _ = strategy.aggregate_train(1, [r1, r2])
    np.testing.assert_allclose(from_array_record(arrays)["l.lora_A"], 2.5 * np.ones((1, 2)))
