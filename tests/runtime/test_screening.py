"""Issue 15, item 2: outlier updates are screened out and claimed example counts clipped,
for every method, on by default; ``screen_updates=False`` is the paper's plain rule."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.methods.registry import get_method, method_names
from flower_app.wire.records import from_array_record, to_array_record
from strategies.florg.rule import aggregate_florg
from tests.harness.strategy_helpers import strategy_for

METHODS = method_names()

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

N = 5
R, K = 4, 16


def florg_state(rng) -> dict[str, np.ndarray]:
    return {
        "enc.q.A": 0.02 * rng.standard_normal((R, K)),
        "enc.v.A": 0.02 * rng.standard_normal((R, K)),
        "classifier.weight": 0.02 * rng.standard_normal((3, K)),
    }


def lora_state(method: str, rng) -> dict[str, np.ndarray]:
    parts = {"ffa-lora": ("B",), "fedsa-lora": ("A",)}.get(method, ("A", "B"))
    state = {"classifier.weight": 0.02 * rng.standard_normal((3, K))}
    for layer in ("enc.q", "enc.v"):
        if "A" in parts:
            state[f"{layer}.lora_A"] = 0.02 * rng.standard_normal((R, K))
        if "B" in parts:
            state[f"{layer}.lora_B"] = 0.01 * rng.standard_normal((K, R))
    return state


def lora_sb_state(rng) -> dict[str, np.ndarray]:
    return {
        "enc.q.R": 0.02 * rng.standard_normal((R, R)),
        "enc.v.R": 0.02 * rng.standard_normal((R, R)),
        "classifier.weight": 0.02 * rng.standard_normal((3, K)),
    }


def state_for(method: str, rng) -> dict[str, np.ndarray]:
    if get_method(method).adapter == "lora-sb":
        return lora_sb_state(rng)
    return florg_state(rng) if method.startswith("florg") else lora_state(method, rng)


def honest(prev, rng, step=0.01, spread=1.0):
    """A client's update: the previous state plus a random step of size ~ step * spread."""
    return {k: v + step * spread * rng.standard_normal(v.shape) for k, v in prev.items()}


def reply(state, pid, n=100) -> Message:
    metrics = {"num-examples": n, "train-loss": 1.0, "partition-id": pid}
    content = RecordDict({"arrays": to_array_record(state), "metrics": MetricRecord(metrics)})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def scaled(state, factor):
    return {
        k: v * factor if k.endswith((".A", ".lora_A", ".lora_B", ".R")) else v
        for k, v in state.items()
    }


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("factor", [10.0, 100.0])
def test_a_scaled_adapter_is_screened_out_for_every_method(method, factor, caplog):
    rng = np.random.default_rng(1)
    prev = state_for(method, rng)
    clients = [honest(prev, rng, spread=s) for s in (0.5, 1.0, 1.5, 2.0, 1.0)]
    clients[3] = scaled(clients[3], factor)
    strategy = strategy_for(method, prev)
    with caplog.at_level(logging.WARNING, logger="flwr.florg"):
        arrays, metrics = strategy.aggregate_train(
            1, [reply(get_method(method).uplink(c, 1), i) for i, c in enumerate(clients)]
        )
    assert metrics["screened"] == 1 and metrics["clients"] == N - 1
    assert "screened out update from partition 3" in caplog.text
    # the same as aggregating the four honest clients alone
    reference = strategy_for(method, prev, screen_updates=False)
    expected, _ = reference.aggregate_train(
        1, [reply(get_method(method).uplink(c, 1), i) for i, c in enumerate(clients) if i != 3]
    )
    for key, value in from_array_record(expected).items():
        np.testing.assert_allclose(from_array_record(arrays)[key], value, rtol=1e-6, atol=1e-9)


def test_without_screening_florg_is_dominated_by_a_x10_client():
    """Q = sum_n w_n A_n^T A_n (paper, eq. Gram_agg): 10 A weighs 100x its share."""
    rng = np.random.default_rng(2)
    prev = florg_state(rng)
    clients = [honest(prev, rng) for _ in range(N)]
    clients[0] = scaled(clients[0], 10.0)
    strategy = strategy_for("florg", prev, screen_updates=False)
    arrays, metrics = strategy.aggregate_train(1, [reply(c, i) for i, c in enumerate(clients)])
    assert metrics["screened"] == 0 and metrics["clients"] == N
    grams = [c["enc.q.A"].T @ c["enc.q.A"] for c in clients]
    share = np.trace(grams[0]) / sum(np.trace(g) for g in grams)
    assert share > 0.95  # 100 / 104 with equal honest norms
    new = from_array_record(arrays)["enc.q.A"]
    assert np.linalg.norm(new) > 4 * np.linalg.norm(prev["enc.q.A"])


def test_screening_keeps_every_honest_client_when_steps_differ_up_to_8_fold():
    rng = np.random.default_rng(3)
    prev = florg_state(rng)
    for spreads in ((1.0, 1.0, 1.0, 1.0, 1.0), (0.2, 0.5, 1.0, 1.5, 6.0), (1.0, 8.0)):
        clients = [honest(prev, rng, spread=s) for s in spreads]
        strategy = strategy_for("florg", prev)
        _, metrics = strategy.aggregate_train(1, [reply(c, i) for i, c in enumerate(clients)])
        assert metrics["screened"] == 0 and metrics["clipped"] == 0, spreads
        assert metrics["screen-ratio-max"] < 10.0


def test_a_poisoned_head_is_screened_too():
    rng = np.random.default_rng(4)
    prev = florg_state(rng)
    clients = [honest(prev, rng) for _ in range(N)]
    clients[2]["classifier.weight"] = 100 * clients[2]["classifier.weight"]
    _, metrics = strategy_for("florg", prev).aggregate_train(
        1, [reply(c, i) for i, c in enumerate(clients)]
    )
    assert metrics["screened"] == 1


def test_a_claim_of_a_billion_examples_is_clipped(caplog):
    rng = np.random.default_rng(5)
    prev = florg_state(rng)
    clients = [honest(prev, rng) for _ in range(N)]
    claims = [100, 120, 90, 110, 10**9]
    messages = [reply(c, i, n) for i, (c, n) in enumerate(zip(clients, claims, strict=True))]
    strategy = strategy_for("florg", prev, aggregation_weights="num-examples")
    with caplog.at_level(logging.WARNING, logger="flwr.florg"):
        arrays, metrics = strategy.aggregate_train(1, messages)
    assert metrics["clipped"] == 1 and metrics["screened"] == 0 and metrics["clients"] == N
    assert "claims 1e+09 examples, clipped to 1100" in caplog.text
    weights = np.array([100, 120, 90, 110, 1100]) / 1520  # kappa 10 x the median claim 110
    As = [c["enc.q.A"].astype(np.float32) for c in clients]
    expected, _ = aggregate_florg(As, weights, prev["enc.q.A"])
    np.testing.assert_allclose(from_array_record(arrays)["enc.q.A"], expected, rtol=1e-6)
    assert metrics["examples"] == 1520
    plain = strategy_for("florg", prev, aggregation_weights="num-examples", screen_updates=False)
    _, unscreened = plain.aggregate_train(1, messages)
    assert unscreened["clipped"] == 0 and unscreened["examples"] > 1e9


def test_replies_are_aggregated_in_partition_order_whatever_the_arrival_order():
    rng = np.random.default_rng(6)
    prev = florg_state(rng)
    clients = [honest(prev, rng) for _ in range(N)]
    messages = [reply(c, i) for i, c in enumerate(clients)]
    a, _ = strategy_for("florg", prev).aggregate_train(1, messages)
    b, _ = strategy_for("florg", prev).aggregate_train(1, messages[::-1])
    for key, value in from_array_record(a).items():
        np.testing.assert_array_equal(from_array_record(b)[key], value)


def test_kappa_below_one_is_refused():
    from flower_app.methods.registry import get_method
    from strategies.server.strategy import AdapterStrategy

    with pytest.raises(ValueError, match="screen-kappa"):
        strategy_for("fedit", {"l.lora_A": np.zeros((1, 2))}, screen_kappa=0.5)
    with pytest.raises(ValueError, match="screen_kappa"):
        AdapterStrategy(
            {"l.lora_A": np.zeros((1, 2))}, method=get_method("fedit"), screen_kappa=0.5
        )


def test_every_round_reports_the_update_norms_that_dp_clips():
    """``update-norm-median`` / ``update-norm-max``: ||reply - start|| over all arrays (adapter
    and head jointly), the unit dp=central clips to C (docs/privacy.md, "Choosing C")."""
    from strategies.server.replies import Reply, screen

    rng = np.random.default_rng(3)
    prev = florg_state(rng)
    steps = [0.5, 1.0, 2.0, 8.0]
    replies = [
        Reply(node=i, partition=i, arrays={k: v + s for k, v in prev.items()}, num_examples=10,
              train_loss=1.0)
        for i, s in enumerate(steps)
    ]  # fmt: skip
    size = sum(v.size for v in prev.values())
    _, _, metrics = screen(1, replies, prev, kappa=10.0, enabled=False)
    norms = [s * np.sqrt(size) for s in steps]
    assert metrics["update-norm-median"] == pytest.approx(np.median(norms), rel=1e-12)
    assert metrics["update-norm-max"] == pytest.approx(norms[-1], rel=1e-12)
    _, _, alone = screen(1, replies[:1], prev, kappa=10.0, enabled=True)
    assert alone["update-norm-median"] == alone["update-norm-max"] == pytest.approx(norms[0])
