"""round-mode=async's server update on the strategies (no Flower run): a buffer holding
stale replies moves the model by each reply's staleness-scaled delta from the version it
trained from (FedBuff), through the method's own rule; a buffer of fresh replies is the
synchronous round, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import strategies.registry  # noqa: F401  (the methods register)
from flower_app.methods.registry import get_method
from strategies.florg.buffered_rule import aggregate_florg_buffered
from strategies.florg.strategy import FLoRGStrategy
from strategies.server.buffered_update import AsyncSettings, staleness_factor
from strategies.server.replies import Reply
from strategies.server.strategy import AdapterStrategy

HEAD = "classifier.weight"
EXPONENT = 0.5


def lora_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "l0.lora_A": rng.normal(size=(2, 6)),
        "l0.lora_B": rng.normal(size=(5, 2)),
        HEAD: rng.normal(size=(2, 5)),
    }


def florg_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "l0.A": rng.normal(size=(2, 6)),
        "l1.A": rng.normal(size=(2, 6)),
        HEAD: rng.normal(size=(2, 5)),
    }


def strategy(method: str, state: dict[str, np.ndarray]) -> AdapterStrategy:
    settings = AsyncSettings(staleness_exponent=EXPONENT)
    common = {"method": get_method(method), "screen_updates": False, "async_rounds": settings}
    if method == "florg":
        return FLoRGStrategy(state, fedavg_gap="off", server_device="cpu", **common)
    return AdapterStrategy(state, **common)


def replies(rng, state, starts, staleness, sizes) -> list[Reply]:
    return [
        Reply(node=10 + i, partition=i, num_examples=float(n), train_loss=0.5,
              arrays={k: (v + 0.1 * rng.normal(size=v.shape)).astype(np.float32)
                      for k, v in start.items()},
              start=start, staleness=tau)
        for i, (start, tau, n) in enumerate(zip(starts, staleness, sizes, strict=True))
    ]  # fmt: skip


def test_fedit_moves_the_model_by_the_stale_deltas():
    rng = np.random.default_rng(0)
    old, current = lora_state(rng), lora_state(rng)
    s = strategy("fedit", current)
    buffer = replies(rng, current, [old, current, old], [2, 0, 1], [1, 1, 1])
    s.aggregate_replies(3, buffer)
    w = np.full(3, 1 / 3)
    for key in current:
        expected = current[key] + sum(
            wi
            * staleness_factor(r.staleness, EXPONENT)
            * (r.arrays[key].astype(np.float64) - r.start[key])
            for wi, r in zip(w, buffer, strict=True)
        )
        assert np.allclose(s.global_state[key], expected, atol=1e-12), key


def test_florg_decomposes_the_gram_average_moved_by_the_stale_replies():
    rng = np.random.default_rng(1)
    old, current = florg_state(rng), florg_state(rng)
    s = strategy("florg", current)
    buffer = replies(rng, current, [old, current, current], [1, 0, 0], [1, 1, 1])
    s.aggregate_replies(2, buffer)
    factors = [staleness_factor(r.staleness, EXPONENT) for r in buffer]
    for key in ("l0.A", "l1.A"):
        expected, _ = aggregate_florg_buffered(
            [r.arrays[key] for r in buffer], [r.start[key] for r in buffer], None, factors,
            current[key],
        )  # fmt: skip
        assert np.allclose(s.global_state[key], expected, atol=1e-10), key
    moved = [
        current[HEAD] + c * (r.arrays[HEAD] - r.start[HEAD])
        for r, c in zip(buffer, factors, strict=True)
    ]
    assert np.allclose(s.global_state[HEAD], np.mean(moved, axis=0), atol=1e-12)
    assert "negative_share" in s.round_metrics[2]


@pytest.mark.parametrize("method", ["florg", "fedit"])
def test_a_buffer_of_fresh_replies_is_the_synchronous_round(method: str):
    make = florg_state if method == "florg" else lora_state
    rng = np.random.default_rng(2)
    current = make(rng)
    buffer = replies(rng, current, [current] * 3, [0, 0, 0], [1, 2, 3])
    buffered, synchronous = strategy(method, current), strategy(method, current)
    synchronous.round_loop = None
    buffered.aggregate_replies(1, buffer)
    synchronous.aggregate_replies(
        1, [Reply(r.node, r.partition, r.arrays, r.num_examples, r.train_loss) for r in buffer]
    )
    for key in current:
        assert buffered.global_state[key].tobytes() == synchronous.global_state[key].tobytes()
